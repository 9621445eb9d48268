# The quick start: a CPU-sized model and a short run on the built-in corpus. Put it after any variant file,
#   python train.py configs/dyn_exo.py configs/tiny.py
# 4 layers of width 128, 256-token windows; 150 steps of 2,048 tokens (307K tokens; the corpus has 4.9M train tokens
# on Debian's Python, the smallest build measured, so no batch repeats). On 2 CPU cores the run takes under 5
# minutes; the logits over GPT-2's 50,304 tokens are most of its cost, so that is set by the tokens per step, not by
# the width. (The README's study ran this at --max_steps=200.)
n_layer = 4
n_embd = 128
n_head = 4
block_size = 256
batch_size = 8
total_batch_size = 2048
max_steps = 150
warmup_steps = 20
eval_interval = 50
eval_tokens = 32768
# Muon's momentum ramps: the paper's 100 steps are 0.3% of its 38,147; at 150 steps they would overlap, and
# momentum would never reach 0.95. 20 steps, like the warmup.
muon_momentum_steps = 20
# The built-in corpus: this Python's standard library, built by train.py the first time (data.py), no download
data_dir = "data/stdlib"
