# Control at the 1B size (not in the paper, §4.1 lacks it): static E-ExoFormer, no dynamic mixing
gate = True
anchor = 'exo'
mix = 'qkvg'
granularity = 'elementwise'
anchor_norm = True
dynamic = False
n_layer = 32
n_embd = 1536
n_head = 16
