# Size only: follows any variant file to make a CPU-sized model of it,
#   python train.py configs/dyn_exo.py configs/tiny.py
n_layer = 4
n_embd = 128
n_head = 4
block_size = 256
