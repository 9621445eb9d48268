# Ablation NKQR: internal anchors without the query/key residual (only v and g are mixed), elementwise, no normalisation
gate = True
anchor = 'internal'
mix = 'vg'
granularity = 'elementwise'
anchor_norm = False
dynamic = False
n_layer = 29
n_embd = 1024
n_head = 16
