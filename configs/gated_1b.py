# Gated Attention at the 1B size (paper §4.1)
gate = True
anchor = 'none'
mix = ''
granularity = 'scalar'
anchor_norm = False
dynamic = False
n_layer = 32
n_embd = 1536
n_head = 16
