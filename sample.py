"""
Sample text from a checkpoint (train.py's, or one convert.py wrote from the authors' release):

    python sample.py out/ckpt.pt --prompt "The theory of relativity" --num_samples 3 --max_new_tokens 200

Each sample is printed whole, prompt included. Without --prompt the model starts a new document
(<|endoftext|>). The tokenizer is the one the checkpoint records (the data's it trained on; GPT-2's for one written
before tokenizers were recorded, or --tokenizer's). Generation uses model.py's generate with its KV cache; ids the
tokenizer cannot decode (the authors' models have 57601 rows for GPT-2's 50257 tokens) are never sampled.
"""
import argparse
import time

import torch

from engine.checkpoint import load_model, trained_tokenizer
from engine.data import load_encoding
from engine.parallel import Runtime
from model import generate


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Sample text from a checkpoint.")
    p.add_argument("ckpt", help="checkpoint written by train.py or convert.py, a model folder (convert.py "
                                  "--to_hf) or a Hub repository OWNER/NAME holding one")
    p.add_argument("--prompt", default="", help="text to continue (default: a new document)")
    p.add_argument("--num_samples", type=int, default=3, help="samples, generated together in one batch")
    p.add_argument("--max_new_tokens", type=int, default=200, help="tokens generated per sample")
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    p.add_argument("--top_k", type=int, default=200, help="sample among the k likeliest tokens only")
    p.add_argument("--seed", type=int, default=1, help="the same seed gives the same samples")
    p.add_argument("--tokenizer", default=None, help="a .tiktoken ranks file: the checkpoint's own, which it records "
                                                     "(for one that records none: default GPT-2's)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="autocast dtype of the forward pass (default: bfloat16 on cuda, float32 on cpu)")
    args = p.parse_args(argv)
    for name, low in (("num_samples", 1), ("max_new_tokens", 1), ("top_k", 1)):
        if getattr(args, name) < low:
            p.error(f"--{name} {getattr(args, name)}: expected an integer >= {low}")
    if args.temperature < 0:
        p.error(f"--temperature {args.temperature}: expected a number >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    runtime = Runtime.pick(args.device, args.dtype)
    try:  # the checkpoint, then the tokenizer it records
        model, ckpt = load_model(args.ckpt, runtime.device)
        enc = load_encoding(trained_tokenizer(ckpt, args.tokenizer, args.ckpt))
    except (ValueError, OSError, ImportError) as e:  # ImportError: the Hugging Face format's packages
        raise SystemExit(f"sample.py: error: {e}")
    if enc.n_vocab > model.config.vocab_size:
        raise SystemExit(f"sample.py: error: the tokenizer has {enc.n_vocab} tokens, {args.ckpt} only "
                         f"vocab_size={model.config.vocab_size}")
    ids = enc.encode_ordinary(args.prompt) if args.prompt else [enc.eot_token]
    idx = torch.tensor([ids] * args.num_samples, device=runtime.device)
    torch.manual_seed(args.seed)
    t0 = time.time()
    with runtime.autocast():
        out = generate(model, idx, args.max_new_tokens, args.temperature, args.top_k, vocab=enc.n_vocab)
    dt = time.time() - t0
    print(f"{args.ckpt}: {model.config.name}, step {ckpt.get('step')}")
    for i, row in enumerate(out.tolist()):
        print(f"---------- sample {i + 1}\n{enc.decode(row if args.prompt else row[1:])}")
    print(f"---------- {args.num_samples} x {args.max_new_tokens} tokens in {dt:.1f}s "
          f"({args.num_samples * args.max_new_tokens / dt:,.0f} tokens/s)")
    return out


if __name__ == "__main__":
    main()
