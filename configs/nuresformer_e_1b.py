# Control at the 1B size (not in the paper, §4.1 lacks it): E-NuResFormer, internal anchors from layer 1
gate = True
anchor = 'internal'
mix = 'qkvg'
granularity = 'elementwise'
anchor_norm = True
dynamic = False
n_layer = 32
n_embd = 1536
n_head = 16
