# ExoFormer (elementwise): exogenous anchors from the embeddings, normalised, mixed into q, k, v and gate logits
gate = True
anchor = 'exo'
mix = 'qkvg'
granularity = 'elementwise'
anchor_norm = True
dynamic = False
n_layer = 29
n_embd = 1024
n_head = 16
