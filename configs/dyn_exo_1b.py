# Dynamic E-ExoFormer at the 1B size (paper §4.1)
gate = True
anchor = 'exo'
mix = 'qkvg'
granularity = 'elementwise'
anchor_norm = True
dynamic = True
n_layer = 32
n_embd = 1536
n_head = 16
