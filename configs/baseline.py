# Baseline Transformer (pre-norm, RMSNorm, QK-norm, RoPE, SwiGLU), 450M
gate = False
anchor = 'none'
mix = ''
granularity = 'scalar'
anchor_norm = False
dynamic = False
n_layer = 32
n_embd = 1024
n_head = 16
