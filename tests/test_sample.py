"""sample.py: prompts, reproducible samples, ids the tokenizer cannot decode, checkpoints of both kinds."""
import dataclasses
import os

import pytest
import torch

import sample
from engine.data import load_encoding
from model import GPT, GPTConfig
from tools import convert

# more rows than the test tokenizer's 291 tokens, as the authors' 57601 rows are more than GPT-2's 50257
CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=32, vocab_size=320, gate=True, anchor="exo",
                   mix="qkvg", granularity="elementwise", anchor_norm=True, dynamic=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A random model whose highest logits are on ids the tokenizer does not have: sampling must skip them."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        model.lm_head.weight[291:] += 5 * model.lm_head.weight[291:].sign()  # large logits past the tokenizer
    path = tmp_path_factory.mktemp("ckpt") / "ckpt.pt"
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(CONFIG), "step": 7,
                "optimizers": [{}]}, path)
    return str(path)


def run(capsys, *args):
    out = sample.main(list(args))
    return out, capsys.readouterr().out


def test_samples_continue_the_prompt_and_are_reproducible(ckpt, enc_file, capsys):
    args = [ckpt, "--prompt", "the question", "--num_samples", "3", "--max_new_tokens", "20", "--tokenizer",
            str(enc_file), "--seed", "5"]
    out, text = run(capsys, *args)
    assert out.shape == (3, len(load_encoding(str(enc_file)).encode_ordinary("the question")) + 20)
    assert out.max() < 291  # never an id the tokenizer cannot decode
    samples = text.split("---------- sample ")[1:]
    assert len(samples) == 3 and all(s.split("\n", 1)[1].startswith("the question") for s in samples)
    assert "Dynamic E-ExoFormer, step 7" in text.splitlines()[0]
    assert torch.equal(run(capsys, *args)[0], out)  # same seed, same samples
    assert not torch.equal(run(capsys, *args[:-1], "6")[0], out)
    greedy, _ = run(capsys, *args[:-2], "--temperature", "0")
    assert (greedy == greedy[0]).all()  # greedy: every sample the same


def test_no_prompt_starts_a_document_and_exports_work(ckpt, enc_file, tmp_path, capsys):
    export = str(tmp_path / "export.pt")
    convert.convert(ckpt, export)  # the weights-only export convert.py writes
    out, text = run(capsys, export, "--tokenizer", str(enc_file), "--num_samples", "1", "--max_new_tokens", "5")
    assert out[0, 0].item() == 290 and out.shape == (1, 6)  # <|endoftext|> opens it, and is not printed
    printed = text.split("---------- sample 1\n")[1].rsplit("\n----------", 1)[0]
    assert printed == load_encoding(str(enc_file)).decode(out[0, 1:].tolist())


def test_errors(ckpt, enc_file, tmp_path, capsys):
    with pytest.raises(SystemExit, match="no checkpoint there"):
        sample.main([str(tmp_path / "missing.pt"), "--tokenizer", str(enc_file)])
    small = tmp_path / "small.pt"
    torch.save({"model": GPT(dataclasses.replace(CONFIG, vocab_size=64)).state_dict(),
                "model_config": dataclasses.asdict(dataclasses.replace(CONFIG, vocab_size=64))}, small)
    with pytest.raises(SystemExit, match="291 tokens, .* only vocab_size=64"):
        sample.main([str(small), "--tokenizer", str(enc_file)])
    with pytest.raises(SystemExit):
        sample.main([ckpt, "--num_samples", "0"])
    assert os.path.exists(ckpt)


def test_the_checkpoints_tokenizer_needs_no_flag_and_another_is_refused(ckpt, enc_file, tmp_path, capsys):
    """A checkpoint that records its tokenizer (train.py's, of the data it trained on) samples with it, no
    --tokenizer; the same ranks given are accepted, GPT-2's refused in one line."""
    from engine.checkpoint import load_checkpoint, save_checkpoint
    from engine.data import TOKENIZER, read_tokenizer
    recorded = str(tmp_path / "recorded.pt")
    save_checkpoint(recorded, {**load_checkpoint(ckpt, ("step",)), "tokenizer": read_tokenizer(enc_file)})
    args = ["--prompt", "the question", "--num_samples", "1", "--max_new_tokens", "5", "--seed", "5"]
    assert torch.equal(run(capsys, recorded, *args)[0], run(capsys, ckpt, *args, "--tokenizer", str(enc_file))[0])
    assert torch.equal(run(capsys, recorded, *args, "--tokenizer", str(enc_file))[0], run(capsys, recorded, *args)[0])
    with pytest.raises(SystemExit, match=r"^sample.py: error: --tokenizer .*gpt2.tiktoken: gpt2.tiktoken \(50,257 "
                                         r"tokens, <\|endoftext\|> 50256\), but .*recorded.pt was trained with "
                                         r"test.tiktoken \(291 tokens, <\|endoftext\|> 290\), which it records "
                                         r"\(leave --tokenizer out\)$"):
        sample.main([recorded, "--tokenizer", TOKENIZER])
