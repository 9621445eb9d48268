# Gated Attention: sigmoid gate on the attention output; 29 layers to match the baseline's parameters
gate = True
anchor = 'none'
mix = ''
granularity = 'scalar'
anchor_norm = False
dynamic = False
n_layer = 29
n_embd = 1024
n_head = 16
