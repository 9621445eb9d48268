# Ablation: E-NuResFormer without anchor normalisation
gate = True
anchor = 'internal'
mix = 'qkvg'
granularity = 'elementwise'
anchor_norm = False
dynamic = False
n_layer = 29
n_embd = 1024
n_head = 16
