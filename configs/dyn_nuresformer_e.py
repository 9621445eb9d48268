# Control (not in the paper): Dynamic E-NuResFormer, internal anchors from layer 1 with the dynamic scales of
# Eq. 12: what Dynamic E-ExoFormer gains from its exogenous anchors, with the dynamic mixing held equal
gate = True
anchor = 'internal'
mix = 'qkvg'
granularity = 'elementwise'
anchor_norm = True
dynamic = True
n_layer = 29
n_embd = 1024
n_head = 16
