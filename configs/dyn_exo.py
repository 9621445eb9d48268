# Dynamic E-ExoFormer: elementwise ExoFormer whose λ are scaled per token by a small MLP (Eq. 12)
gate = True
anchor = 'exo'
mix = 'qkvg'
granularity = 'elementwise'
anchor_norm = True
dynamic = True
n_layer = 29
n_embd = 1024
n_head = 16
