# Control (not in the paper): Dynamic E-ExoFormer whose anchor projection stays at its random initialisation,
# the falsifier of the paper's review: if the gains persist, they do not come from a learned anchor projection
gate = True
anchor = 'exo'
mix = 'qkvg'
granularity = 'elementwise'
anchor_norm = True
dynamic = True
anchor_frozen = True
n_layer = 29
n_embd = 1024
n_head = 16
