# ResFormer: value residual from layer 1, scalar λ, no normalisation
gate = False
anchor = 'internal'
mix = 'v'
granularity = 'scalar'
anchor_norm = False
dynamic = False
n_layer = 32
n_embd = 1024
n_head = 16
