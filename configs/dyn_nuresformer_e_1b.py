# Control at the 1B size (not in the paper, §4.1 lacks it): Dynamic E-NuResFormer, the dynamic internal-anchor twin
# of Dynamic E-ExoFormer 1B
gate = True
anchor = 'internal'
mix = 'qkvg'
granularity = 'elementwise'
anchor_norm = True
dynamic = True
n_layer = 32
n_embd = 1536
n_head = 16
