"""What README.md and docs/*.md promise, checked against the code: every command of every page names a script that
exists, flags its --help lists, config files that exist and keys that are keys; every command that launches a config
on a GPU fits the micro-batch docs/MEMORY.md gives it; every `python train.py` run of the pages runs, at a tiny size on
a few synthetic shards; the middle step costs what the README says; the study's tables are its results' files; the
Tests section of docs/REFERENCE.md names every test file. The pages are found, not listed: a new docs/*.md is checked
as it lands. (The quick start itself, from a fresh copy with its corpus built, is test_train.py's.)"""
import ast
import contextlib
import functools
import glob
import importlib
import io
import json
import os
import re
import shlex

import numpy as np
import pytest
import torch

import train
from engine.configurator import load_config, read_args
from engine.data import write_shard
from model import GPT, GPTConfig, flops_per_token

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
LAUNCHERS = ("python", "torchrun", "sbatch")
TRAIN_LIKE = ("train.py", "tools/train.sbatch")  # scripts whose arguments are train.py's: config files and --key=value
# Config files a page names that a reader writes: the fork's own variant (docs/FORKING.md: Other changes)
PLACEHOLDER_FILES = {"configs/yours.py"}
SIZE_KEYS = ("n_layer", "n_embd", "n_head", "block_size")
# FineWeb-Edu's train shards as prepare.py fetches them (kjj0/finewebedu10B-gpt2): 10^8 tokens each, llm.c's
# fineweb.py shard size (docs/REFERENCE.md: about 100M tokens, 200 MB each)
SHARD_TOKENS = 100_000_000


def read(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


# ----------------------------------------------------------------------------- the commands of the pages

def commands(page):
    """(where, words) of every command of a page, from its launcher (python, torchrun, sbatch) on: each line of a
    bash block (continuations joined, `name="..."` of the block put in for $name, commands split at && and ;) and
    each inline `python ...` or `torchrun ...` of the prose (its [optional] brackets dropped)."""
    found, prose, block, variables = [], [], None, {}
    lines = read(page).split("\n")
    n = 0
    while n < len(lines):
        line, start = lines[n], n + 1
        fence = re.match(r"^\s*```(\w*)\s*$", line)
        n += 1
        if fence:
            block, variables = (fence[1] if block is None else None), {}
            continue
        if block is None:
            prose.append(line)
            continue
        if block not in ("bash", "sh"):
            continue
        while line.endswith("\\") and n < len(lines):
            line, n = line[:-1] + " " + lines[n].strip(), n + 1
        assignment = re.match(r'^(\w+)="([^"]*)"$', line.strip())
        if assignment:
            variables[assignment[1]] = assignment[2]
            continue
        line = re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m[1], m[0]), line)
        found += [(f"{page}:{start}", words) for words in launched(shlex.split(line, comments=True))]
    for span in re.findall(r"`([^`]+)`", "\n".join(prose)):
        span = " ".join(span.split())
        if span.startswith(("python ", "torchrun ")):
            found += [(f"{page}: `{span[:40]}`", words) for words in launched(shlex.split(span.replace("[", " ")
                                                                                          .replace("]", " ")))]
    return found


def placeholder(word):
    """A word that stands for what the reader gives: CKPT, OWNER/NAME, FILES, a value --seed=S."""
    return re.fullmatch(r"[A-Z][A-Z0-9_/]*", word.split("=", 1)[-1]) is not None


def launched(words):
    """Each command of a shell line's words that starts at a launcher (after `env X=1`, `ip netns exec H` ...)."""
    out, part = [], []
    for w in words + ["&&"]:
        if w in ("&&", ";", "||"):
            start = next((i for i, x in enumerate(part) if x in LAUNCHERS), None)
            if start is not None:
                out.append([x for x in part[start:] if not x.endswith("...") and not (placeholder(x) and
                                                                                    not x.startswith("-"))])
            part = []
        else:
            part.append(w)
    return out


def split_command(words):
    """(script, its arguments, processes) of a command's words: python X.py, python -m M, torchrun [its flags] X.py,
    sbatch [its options] SCRIPT. A tool run as a module, python -m tools.X (or torchrun's -m), is its file tools/X.py;
    another module, `-m M`. Raises ValueError for a torchrun flag that torchrun does not know."""
    launcher, rest = words[0], words[1:]
    if "-m" in rest and rest[rest.index("-m") + 1].startswith(("tools.", "tests.")):  # its file, as a script
        at = rest.index("-m")
        rest = rest[:at] + [rest[at + 1].replace(".", "/") + ".py"] + rest[at + 2:]
    if launcher == "python":
        return (f"-m {rest[1]}", rest[2:], 1) if rest[:1] == ["-m"] else (rest[0], rest[1:], 1)
    own = rest[:next((i for i, w in enumerate(rest) if not w.startswith("-")), len(rest))]
    script, args = (rest[len(own)], rest[len(own) + 1:]) if own != rest else (None, [])  # None: its flags, named
    options = {o.split("=")[0][2:].replace("-", "_"): o.split("=", 1)[1] for o in own if o[:2] == "--" and "=" in o}
    if launcher == "torchrun":
        unknown = [o for o in own if o.split("=")[0] not in torchrun_flags()]
        if unknown:
            raise ValueError(f"torchrun has no {unknown[0].split('=')[0]}")
        per_node, nodes = options.get("nproc_per_node", "1"), options.get("nnodes", "1")
        return script, args, int(per_node) * int(nodes) if (per_node + nodes).isdigit() else None
    tasks = options.get("ntasks") or int(options.get("ntasks_per_node", 1)) * int(options.get("nodes", 1))
    return script, args, int(tasks)


@functools.cache
def torchrun_flags():
    from torch.distributed.run import get_args_parser
    return {s for a in get_args_parser()._actions for s in a.option_strings}


@functools.cache
def help_flags(script):
    """The flags that `python SCRIPT --help` lists (argparse's scripts), read in this process."""
    module = importlib.import_module(script[:-3].replace("/", "."))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        module.main(["--help"])
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", out.getvalue()))


def train_args(args):
    """(config files, --key=value overrides) of train.py's arguments."""
    return [a for a in args if not a.startswith("-")], [a for a in args if a.startswith("-") and a != "--help"]


def every_command():
    return [(where, words) for page in PAGES for where, words in commands(page)]


def test_every_command_of_the_pages_names_a_script_flags_files_and_keys_that_exist():
    """Statically, in this one process: each documented command's script exists; an argparse script's --help lists its
    flags; train.py's, bench.py's and sweep.py's keys are train.ALL_DEFAULTS's (and bench.py's own); every config
    file exists, and every key it sets is one."""
    from tools import bench
    errors, found = [], every_command()
    for where, words in found:
        try:
            script, args, _ = split_command(words)
            if script is None:  # torchrun's flags, named in the prose
                continue
            if script == "-m pytest":
                missing = [a for a in args if a.endswith(".py") and not os.path.exists(os.path.join(ROOT, a))]
                if missing:
                    raise ValueError(f"no {missing[0]}")
                continue
            if script.startswith("-m "):
                raise ValueError(f"python {script}: not a command of this repository")
            if not os.path.exists(os.path.join(ROOT, script)):
                raise ValueError(f"no script {script}")
            files, overrides = train_args(args)
            if script in TRAIN_LIKE:
                variants, defaults = [files], train.ALL_DEFAULTS
            elif script == "tools/bench.py":  # each file a model of its own: a variant file, its size given as keys
                variants, defaults = [[f] for f in files] or [[]], {**train.ALL_DEFAULTS, **bench.BENCH_DEFAULTS}
                overlays = [f for f in files if f not in PLACEHOLDER_FILES and "gate" not in read_args([f], defaults)]
                if overlays:
                    raise ValueError(f"bench.py takes each file as a model, and {overlays[0]} names no variant "
                                     f"(a size goes in as --key=value)")
            else:
                flags = help_flags(script)
                unknown = [o.split("=")[0] for o in overrides if o.split("=")[0] not in flags]
                if script != "tools/sweep.py":
                    if unknown:
                        raise ValueError(f"{script} --help lists no {unknown[0]}")
                    continue
                own = {o for o in overrides if o.split("=")[0] in flags}
                variants = [v.split("+") for v in files if v.endswith(".py")] or [[]]
                overrides, defaults = [o for o in overrides if o not in own], train.ALL_DEFAULTS
            for variant in variants:
                variant = [f for f in variant if f not in PLACEHOLDER_FILES]
                missing = [f for f in variant if not os.path.isfile(os.path.join(ROOT, f))]
                if missing:
                    raise ValueError(f"no config file {missing[0]}")
                given = [f"{o.split('=')[0]}={defaults[o[2:].split('=')[0]]}" if placeholder(o) and "=" in o and
                         o[2:].split("=")[0] in defaults else o for o in overrides]  # --seed=S: its key checked
                read_args(variant + given, defaults)
        except (ValueError, IndexError) as e:
            errors.append(f"{where}: {' '.join(words)}: {type(e).__name__}: {e}")
    assert not errors, "\n".join(errors)
    assert len(found) > 50  # the pages' commands were found


# ----------------------------------------------------------------------------- memory: docs/MEMORY.md is the source

def memory_tables():
    """docs/MEMORY.md's tables: {(config, checkpointing): micro-batches} per GPU (every GPU holds the whole model),
    {(config, GPUs): (micro-batches, with checkpointing)} under FSDP (GPUs '1 (DDP)': without it), the GPU sizes of
    their columns, and the GPU size the pages are sized for."""
    text = read("docs/MEMORY.md")
    prose = " ".join(text.split())
    sized_for = int(re.search(r"sized for (\d+) GB GPUs", prose)[1])
    sizes = [int(g) for g in re.search(r"micro-batch that fits ([\d /]+) GB", prose)[1].split("/")]
    fits = lambda cell: [int(b) for b in cell.split("/")]
    per_gpu, sharded, config = {}, {}, None
    for row in re.findall(r"(?m)^\|(.*)\|$", text):
        cells = [c.strip() for c in row.split("|")]
        if len(cells) == 6 and re.fullmatch(r"\d+ / \d+ / \d+", cells[5]):
            name = cells[0].replace("`", "")
            per_gpu[(name.replace(" + checkpointing", ""), name.endswith(" + checkpointing"))] = fits(cells[5])
        elif len(cells) == 9 and re.fullmatch(r"\d+ / \d+ / \d+", cells[7]):
            config = cells[0].replace("`", "") or config
            sharded[(config, cells[4])] = (fits(cells[7]), fits(cells[8]))
    return per_gpu, sharded, sizes, sized_for


def label(files):
    """docs/MEMORY.md's name of the model of these config files: `gated_1b.py`, `dyn_exo.py + small.py`, and
    `dyn_exo.py 7B` for a variant file then configs/size_7b.py."""
    names = [os.path.basename(f) for f in files]
    size = re.fullmatch(r"size_(\d+b)\.py", names[-1]) if names else None
    return " + ".join(names[:-1]) + f" {size[1].upper()}" if size else " + ".join(names)


def gpu_runs(script, args, processes):
    """(config files, flat configuration, processes) of each run a command launches at a GPU's size: train.py's,
    train.sbatch's, each variant of sweep.py's (one GPU a run). The quick start's and the tests' CPU sizes
    (configs/tiny.py, a size on the command line), runs of a checkpoint's model (no config file) and dry runs are
    not."""
    files, overrides = train_args(args)
    if "--dry_run=True" in overrides:  # traced on a CPU: it launches nothing
        return
    if script == "tools/sweep.py":
        runs = [(v.split("+"), 1) for v in files if v.endswith(".py")]  # one GPU a run
        overrides = [o for o in overrides if o.split("=")[0] not in help_flags("tools/sweep.py")]
    else:
        runs = [(files, processes)] if script in TRAIN_LIKE and files else []
    for files, n in runs:
        if "configs/tiny.py" in files or any(o[2:].split("=")[0] in SIZE_KEYS for o in overrides):
            continue
        try:
            yield files, load_config(files + overrides, train.ALL_DEFAULTS), n
        except ValueError:
            continue  # a key that is none: the static test reports it


def test_every_command_that_launches_a_config_fits_the_memory_table():
    """The micro-batch of every documented run of a config on GPUs is at most what docs/MEMORY.md's table gives that
    config on the GPU size the pages are sized for (with activation checkpointing when the run has it; under FSDP,
    at its number of GPUs). A config the table lacks is an error too: its command's memory is then unknown."""
    per_gpu, sharded, sizes, sized_for = memory_tables()
    column = sizes.index(sized_for)
    errors, checked = [], 0
    for where, words in every_command():
        try:
            script, args, processes = split_command(words)
        except (ValueError, IndexError):
            continue  # the test above reports it
        for files, flat, n in gpu_runs(script, args, processes):
            name, ckpt, batch = label(files), flat["activation_checkpointing"], flat["batch_size"]
            if any(key[0] == name for key in sharded):
                gpus = str(n) if flat["fsdp"] else "1 (DDP)"
                if (name, gpus) not in sharded:
                    errors.append(f"{where}: docs/MEMORY.md has no row for {name} on {gpus} GPUs")
                    continue
                fits = sharded[(name, gpus)][int(ckpt)][column]
            elif (name, ckpt) in per_gpu:
                fits = per_gpu[(name, ckpt)][column]
            else:
                errors.append(f"{where}: docs/MEMORY.md has no row for {name}{' + checkpointing' * ckpt}")
                continue
            checked += 1
            if batch > fits:
                errors.append(f"{where}: batch_size={batch} for {name}, where docs/MEMORY.md fits {fits} on "
                              f"{sized_for} GB")
    assert not errors, "\n".join(errors)
    assert checked >= 10  # the paper's commands, the 1B ones, the 7B one, the sweeps', the middle step's


def test_the_memory_table_reads_as_its_test_reads_it():
    """The test above reads docs/MEMORY.md's tables: every row, the 1B configs' and the 7B's among them."""
    per_gpu, sharded, sizes, sized_for = memory_tables()
    assert sizes == [40, 80, 141] and sized_for in sizes
    assert {("gated_1b.py", False), ("dyn_exo_1b.py", False), ("dyn_exo.py + small.py", False),
            ("dyn_exo.py", True)} <= set(per_gpu)
    assert {("dyn_exo.py 7B", "8"), ("dyn_exo.py 7B", "1 (DDP)"), ("gated.py 3B", "64")} <= set(sharded)
    assert label(["configs/dyn_exo.py", "configs/size_7b.py"]) == "dyn_exo.py 7B"


# ----------------------------------------------------------------------------- the documented runs, at a tiny size

VOCAB = 256
TINY = ["--n_layer=2", "--n_embd=64", "--n_head=2", "--block_size=32", f"--vocab_size={VOCAB}", "--batch_size=2",
        "--total_batch_size=128", "--max_steps=2", "--eval_tokens=128", "--device=cpu"]


def documented_runs():
    """Every `python train.py CONFIG...` of the pages that trains (not --help, not a checkpoint's --eval_only)."""
    runs = []
    for where, words in every_command():
        if words[:2] == ["python", "train.py"] and train_args(words[2:])[0] and not {"--eval_only=True",
                                                                                 "--dry_run=True"} & set(words):
            runs.append(pytest.param(words[2:], id=where))
    return runs


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A few synthetic shards: 3 train and 1 val, random tokens below VOCAB."""
    d = tmp_path_factory.mktemp("shards")
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=4 * 4096)
    write_shard(d / "synthetic_val_000000.bin", tokens[:4096])
    for i in range(1, 4):
        write_shard(d / f"synthetic_train_{i:06d}.bin", tokens[i * 4096:(i + 1) * 4096])
    return str(d)


@pytest.mark.parametrize("args", documented_runs())
def test_every_documented_training_run_runs_at_a_tiny_size(args, shards, tmp_path, monkeypatch):
    """The command's config files and keys as written, with a tiny model, 2 steps and a few synthetic shards instead
    of its size, its data and its out_dir: the quick start's run, the middle step's (its CPU twin) and any other."""
    monkeypatch.chdir(ROOT)  # its config files, as written, relative to the repository
    out = tmp_path / "out"
    train.main(args + TINY + [f"--data_dir={shards}", f"--out_dir={out}"])
    last = [json.loads(line) for line in open(out / "log.jsonl")][-1]
    assert last["step"] == 2 and np.isfinite(last["train_loss"]) and os.path.exists(out / "ckpt.pt")


DRY_SIZE = ["--n_layer=1", "--n_embd=64", "--n_head=2", "--block_size=32", f"--vocab_size={VOCAB}"]


def documented_launches():
    """Every documented launch of train.py (python, torchrun, sbatch of train.sbatch) that starts a run of config
    files: (where, its arguments, processes), each configuration once (at its first place). Continuing a run's
    checkpoint (--init_from=resume, --eval_only) is not."""
    found, seen = [], set()
    for where, words in every_command():
        try:
            script, args, processes = split_command(words)
        except (ValueError, IndexError):
            continue  # the static test reports it
        files, overrides = train_args(args)
        if script in TRAIN_LIKE and files and processes and not any(
                o.startswith(("--init_from=resume", "--eval_only=True", "--dry_run=True")) for o in overrides):
            key = (processes, tuple(sorted((k, v) for k, v in load_config(files + overrides, train.ALL_DEFAULTS)
                                           .items() if k not in train.BRANCH_FREE)))  # what a step holds
            if key not in seen:
                seen.add(key)
                found.append(pytest.param(args, processes, id=where))
    return found


def dry_tiny(args, processes):
    """train.py's arguments for a dry run of a launch at a tiny size: its config files and keys as written, at 2
    layers of width 64 and 32-token windows, with total_batch_size scaled as block_size is, so that what divides at
    the launch's size (micro-steps, processes) divides here too."""
    flat = load_config(train_args(args)[0] + train_args(args)[1], train.ALL_DEFAULTS)
    total = flat["total_batch_size"] * 32 // flat["block_size"]
    return args + DRY_SIZE + [f"--total_batch_size={total}", "--dry_run=True", f"--dry_world_size={processes}"]


@pytest.mark.parametrize("args,processes", documented_launches())
def test_every_documented_launch_dry_runs_at_a_tiny_size(args, processes, monkeypatch, capsys):
    """Each documented launch, dry-run at its number of processes (train.py --dry_run=True: its real step traced on
    fake tensors, dryrun.py) with a tiny model: no error its launch would hit (a batch that does not divide, FSDP's
    or Muon's over its ranks), and it fits. A launch that does not fit fails (test_train.py checks the verdict)."""
    monkeypatch.chdir(ROOT)
    train.main(dry_tiny(args, processes))  # exits 1 when it does not fit or would fail
    out = capsys.readouterr().out
    assert f"dry run: {processes} rank(s)" in out and ": fits (" in out and "error" not in out


def test_the_documented_launches_include_the_multi_gpu_ones():
    launches = {(tuple(p.values[0]), p.values[1]) for p in documented_launches()}
    assert any(n == 8 and "--fsdp=True" in a and "configs/size_7b.py" in a for a, n in launches)
    assert any(n == 8 and "configs/dyn_exo_1b.py" in a for a, n in launches)
    assert max(n for _, n in launches) >= 16  # a multi-node launch


def test_the_pages_runs_include_the_quick_start_and_the_middle_step():
    runs = [p.values[0] for p in documented_runs()]
    assert ["configs/dyn_exo.py", "configs/tiny.py"] in runs and ["configs/dyn_exo.py", "configs/small.py"] in runs


# ----------------------------------------------------------------------------- numbers and their sources

def test_the_middle_step_costs_what_the_readme_says():
    """Its tokens fit the shards its command fetches (no batch repeats), and its FLOPs (model.flops_per_token, as
    train.py's MFU counts them) and its GPU time at the MFU and peak the README assumes are the README's."""
    readme = read("README.md")
    start = readme.index("## A middle step")
    section = " ".join(readme[start:readme.index("\n## ", start + 1)].split())
    words = next(w for _, w in commands("README.md") if "configs/small.py" in w and w[:2] == ["python", "train.py"])
    flat = load_config(train_args(words[2:])[0], train.ALL_DEFAULTS)
    shards = int(re.search(r"python prepare\.py --train_shards (\d+) &&", section)[1])
    tokens = flat["max_steps"] * flat["total_batch_size"]
    assert tokens <= shards * SHARD_TOKENS
    with torch.device("meta"):
        model = GPT(GPTConfig(**{k: flat[k] for k in train.MODEL_KEYS}))
    flops = flops_per_token(model, flat["block_size"]) * tokens
    mfu = int(re.search(r"at an assumed (\d+)% MFU", section)[1]) / 100
    peak = int(re.search(r"\((\d+) TFLOP/s bf16\)", section)[1]) * 1e12
    for said in (f"{model.num_params() / 1e6:.1f}M parameters", f"{tokens / 1e6:,.0f}M tokens",
                 f"{flat['max_steps']:,} of them", f"{flops / 1e17:.1f}·10¹⁷ FLOPs",
                 f"{flops / (mfu * peak) / 60:.0f} minutes"):
        assert said in section, said
    assert "`out/small/ckpt.pt`" in section and flat["out_dir"] == "out/small"


def figure(x, digits, signed=False):
    return f"{'+' if signed and x > 0 else ''}{x:.{digits}f}"


def interval(ci, digits, signed=False):
    return f"[{figure(ci[0], digits, signed)}, {figure(ci[1], digits, signed)}]"


def study_rows(results, readme):
    """The rows of the report `results` (sweep.py's JSON) as the README's table rounds them (readme=True: Δ and its
    interval in one cell, typographic minus signs) or as docs/STUDY.md's does (every figure in a cell of its own)."""
    rows = []
    for name, r in results.items():
        cells = [name, str(r["runs"]), f"{r['mean']:.4f} ± {r['std']:.4f}"]
        ratio = lambda key, d: (figure(r[key], d), interval(r[key + "_ci95"], d)) if r.get(key) else ("–", "–")
        if readme:
            minus = lambda text: text.replace("-", "−")
            cells += (["reference", "–"] if r["reference"] else
                      [minus(f"{figure(r['delta_mean'], 3, True)} {interval(r['delta_ci95'], 3, True)}"),
                       "yes" if r["resolved"] else "no"])
            cells += [" ".join(ratio(k, 2)) if r.get(k) else "–" for k in ("token_ratio", "budget_ratio")]
        else:
            cells.append(interval(r["ci95"], 4))
            cells += (["reference", "–", "–"] if r["reference"] else
                      [figure(r["delta_mean"], 4, True), interval(r["delta_ci95"], 4, True),
                       "yes" if r["resolved"] else "no"])
            cells += [*ratio("token_ratio", 3), *ratio("budget_ratio", 3)]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


@pytest.mark.parametrize("page, results", [("README.md", "docs/results.json"), ("docs/STUDY.md", "docs/results.json"),
                                           ("docs/STUDY.md", "docs/results_pydocs.json")])
def test_the_study_tables_are_their_reports(page, results):
    """The study's tables, every figure as its report (sweep.py's JSON) rounds it."""
    rows = study_rows(json.loads(read(results)), page == "README.md")
    text = read(page)
    missing = [row for row in rows if row not in text]
    assert not missing, f"{page}: rows that differ from {results}:\n" + "\n".join(missing)


def test_the_reference_lists_every_heading_of_its_own():
    """docs/REFERENCE.md's table of contents: one entry per ## and ### heading, in the page's order."""
    reference = read("docs/REFERENCE.md")
    headings = re.findall(r"(?m)^#{2,3} (.*)$", reference[reference.index("\n## "):])
    assert re.findall(r"(?m)^ *- \[([^]]+)\]\(#[^)]+\)$", reference[:reference.index("\n## ")]) == headings


def test_the_reference_names_every_test_file():
    reference = read("docs/REFERENCE.md")
    section = reference[reference.index("\n## Tests"):]
    tests = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "test_*.py")) +
                   glob.glob(os.path.join(ROOT, "tests", "test_*.py")))
    assert [t for t in tests if f"`{t}`" not in section] == [], "docs/REFERENCE.md's Tests section lacks them"


# ----------------------------------------------------------------------------- the repository's layout

FILES = sorted(os.path.relpath(p, ROOT) for pattern in ("*.py", "engine/*.py", "tools/*.py")
               for p in glob.glob(os.path.join(ROOT, pattern))
               if not os.path.basename(p).startswith(("test_", "conftest")))
MODULES = [f[:-3].replace("/", ".").removesuffix(".__init__") for f in FILES]  # engine.checkpoint, ...


def imports(module):
    """The modules of the repository that a module imports, at the top or inside a function: `import a.b`, `from a
    import b` (b a module of a, or a name of a) and `from a.b import c`, each as its dotted name."""
    path = os.path.join(ROOT, module.replace(".", "/") + ("/__init__.py" if module in ("engine", "tools") else ".py"))
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m in MODULES}


def symbol_source(path, symbol):
    """The source lines of a top-level name of a Python file, or of one inside it (`Class.method`), found by name
    (no line number): its definition or assignment, decorators and trailing comments included; None if none."""
    lines = open(path, encoding="utf-8").read().splitlines()
    nodes = ast.parse("\n".join(lines)).body
    for name in symbol.split("."):
        found = [n for n in nodes if getattr(n, "name", None) == name or
                 any(getattr(t, "id", None) == name for t in getattr(n, "targets", ()))]
        if not found:
            return None
        node, nodes = found[0], getattr(found[0], "body", [])
    start = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
    return "\n".join(lines[start - 1:node.end_lineno])


def test_readme_paper_to_code_table_names_symbols_that_carry_their_markers():
    """Each row of README.md's paper-to-code table names a function, class or constant (`file.py:Name` or
    `file.py:Class.method`) that exists and whose source carries the row's marker (Eq. 9, §4.5, step 2. ...): the
    table holds wherever the lines move."""
    rows = re.findall(r"^\| ([^|]+?) \| [^|]+ \| `([\w/]+\.py):([\w.]+)`(?: \(line \d+\))? \|$",
                      open(os.path.join(ROOT, "README.md")).read(), flags=re.M)
    assert len(rows) >= 20, rows
    for marker, name, symbol in rows:
        source = symbol_source(os.path.join(ROOT, name), symbol)
        assert source is not None, f"README.md: the row {marker!r} names {name}:{symbol}, which {name} lacks"
        assert marker in source, f"README.md: the row {marker!r} names {name}:{symbol}, whose source lacks {marker!r}"


def test_each_file_imports_only_from_the_rows_above_it():
    """README.md's file table is the import rule that holds: every module of the repository (the card's at the root,
    the engine's, the tools') is in one row, and each imports (at the top or inside a function) only modules of the
    rows above its own."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    table = readme[readme.index("| file | what it holds |"):].split("\n\n")[0].splitlines()[2:]
    rows = {name.replace("/", "."): i for i, line in enumerate(table)
            for name in re.findall(r"`([\w/]+)\.py`", line.split("|")[1])}
    modules = {m for m in MODULES if m not in ("engine", "tools", "engine.modeling_exoformer")}  # modeling_exoformer:
    #   copied into Hugging Face folders, beside model.py, which it imports relatively
    assert set(rows) == modules, \
        f"README.md: the file table lacks {modules - set(rows)}, or names {set(rows) - modules}"
    for name in modules:
        for other in imports(name) & modules:
            assert rows[other] < rows[name], f"{name} imports {other}, which is not in a row above its own"


def test_only_entry_points_exit():
    """SystemExit (raise SystemExit, sys.exit) comes only from a tool's main or its __main__ block: a library module,
    or a function a fork calls from a notebook or a sweep (train.py's included), raises an exception instead."""
    found = []
    for name in FILES:
        def walk(node, inside):
            for n in ast.iter_child_nodes(node):
                here = inside or (isinstance(n, ast.FunctionDef) and n.name == "main") or (
                    isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
                exits = isinstance(n, ast.Raise) and n.exc is not None and "SystemExit" in ast.unparse(n.exc) or \
                    isinstance(n, ast.Call) and ast.unparse(n.func) in ("sys.exit", "exit")
                if exits and not here:
                    found.append(f"{name}:{n.lineno}")
                walk(n, here)
        walk(ast.parse(open(os.path.join(ROOT, name)).read()), False)
    assert not found, f"SystemExit outside an entry point: {found}"


def test_every_relative_link_of_the_docs_resolves():
    """README.md and docs/*.md link each other by file and heading: every such link names a file that exists and,
    with a #fragment, a heading of it (GitHub's anchors: lower case, spaces as hyphens, punctuation dropped)."""
    def anchors(path):
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                for h in re.findall(r"(?m)^#+ (.*)$", open(path, encoding="utf-8").read())}
    pages = ["README.md"] + [os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                             if f.endswith(".md")]
    for page in pages:
        for link in re.findall(r"\]\(([^)\s]+)\)", open(os.path.join(ROOT, page), encoding="utf-8").read()):
            if link.startswith(("http://", "https://")):
                continue
            path, _, fragment = link.partition("#")
            target = (os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path
                      else os.path.join(ROOT, page))
            assert os.path.exists(target), f"{page}: the link {link} names no file"
            if fragment and target.endswith(".md"):
                assert fragment in anchors(target), f"{page}: the link {link} names no heading of {path or page}"


def test_the_readme_opens_with_a_learners_path_whose_line_counts_hold():
    """README.md's learner's path starts within its first 60 lines and names model.py and train.py; each row's count
    of lines is that of what it names (a file to its banner, the first `# ====` line, or a function), within 10%, and
    together they are the heading's "about N lines", within 10%: the path stays true as the code moves."""
    readme = read("README.md")
    heading = re.search(r"(?m)^## Read it: the paper in about ([\d,]+) lines$", readme)
    assert heading and readme[:heading.start()].count("\n") < 60, "README.md: no learner's path in its first 60 lines"
    section = readme[heading.end():].split("\n## ")[0]
    rows = re.findall(r"(?m)^\| `([\w/]+\.py)(?::(\w+))?`(, to its banner)? \| [^|]+ \| ([\d,]+) \|$", section)
    assert {"model.py", "train.py"} <= {name for name, *_ in rows}, rows
    total = 0
    for name, symbol, banner, stated in rows:
        if symbol:
            counted = len(symbol_source(os.path.join(ROOT, name), symbol).splitlines())
        else:
            assert banner, f"README.md: the learner's path names all of {name}"
            counted = next(i for i, line in enumerate(read(name).splitlines()) if line.startswith("# ====="))
        assert abs(counted - int(stated)) <= 0.1 * counted, f"README.md: {name} {symbol}: {counted} lines, not {stated}"
        total += counted
    assert abs(total - int(heading[1].replace(",", ""))) <= 0.1 * total, f"README.md: the path is {total} lines"
