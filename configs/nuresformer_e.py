# NuResFormer (elementwise): internal anchors from layer 1, normalised, mixed into q, k, v and gate logits
gate = True
anchor = 'internal'
mix = 'qkvg'
granularity = 'elementwise'
anchor_norm = True
dynamic = False
n_layer = 29
n_embd = 1024
n_head = 16
