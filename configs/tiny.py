# A CPU-sized model and a short run (the quick start): put it after any variant file,
#   python train.py configs/dyn_exo.py configs/tiny.py
# 4 layers of width 128, 256-token windows; 150 steps of 4,096 tokens (600K tokens).
n_layer = 4
n_embd = 128
n_head = 4
block_size = 256
batch_size = 8
total_batch_size = 4096
max_steps = 150
warmup_steps = 20
eval_interval = 50
eval_tokens = 65536
# Muon's momentum ramps: the paper's 100 steps are 0.3% of its 38,147; at 150 steps they would overlap, and
# momentum would never reach 0.95. 20 steps, like the warmup (and like it, on the order of a tenth of the run).
muon_momentum_steps = 20
