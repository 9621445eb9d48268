"""Tests of configurator.py: config files in order, then --key=value overrides, with clear errors."""
import pytest

from engine.configurator import help_text, key_comments, load_config, read_args

pytestmark = pytest.mark.quick  # the config and command-line checks, every one
DEFAULTS = dict(n_layer=12, lr=0.01, compile=True, anchor="none", out_dir="out")


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_files_in_order_then_overrides(tmp_path):
    a = write(tmp_path, "a.py", "n_layer = 29\nanchor = 'exo'\nlr = 1\n")
    b = write(tmp_path, "b.py", "import math\nn_layer = 4\n_helper = 3\n")
    config = load_config(["--n_layer=7", a, b, "--compile=False", "--out_dir=123"], DEFAULTS)
    assert config == dict(n_layer=7, lr=1.0, compile=False, anchor="exo", out_dir="123")
    assert type(config["lr"]) is float  # an int where a float is expected is converted
    assert load_config([a, b], DEFAULTS)["n_layer"] == 4  # the later file wins
    assert DEFAULTS["n_layer"] == 12  # defaults are not modified


def test_unknown_key_names_file_close_match_and_valid_keys(tmp_path):
    a = write(tmp_path, "a.py", "n_layers = 29\n")
    with pytest.raises(ValueError) as e:
        load_config([a], DEFAULTS)
    msg = str(e.value)
    assert a in msg and "'n_layers'" in msg and "did you mean n_layer" in msg
    assert "valid keys: anchor, compile, lr, n_layer, out_dir" in msg and "\n" not in msg
    with pytest.raises(ValueError, match=r"--comple=0: unknown key 'comple' \(did you mean compile\?\)"):
        load_config(["--comple=0"], DEFAULTS)


@pytest.mark.parametrize("args,words", [
    (["--n_layer=4.5"], ["--n_layer=4.5", "n_layer=4.5", "float", "expected int"]),
    (["--compile=1"], ["compile=1", "expected bool"]),
    (["--lr=fast"], ["lr='fast'", "expected float"]),
    (["--n_layer", "4"], ["--n_layer", "expected --key=value"]),
    (["missing_config.py"], ["missing_config.py", "cannot read"]),
])
def test_bad_arguments(args, words):
    with pytest.raises(ValueError) as e:
        load_config(args, DEFAULTS)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_wrong_type_in_file(tmp_path):
    a = write(tmp_path, "a.py", "compile = 'yes'\n")
    with pytest.raises(ValueError, match=r"a\.py: compile='yes' is str, expected bool"):
        load_config([a], DEFAULTS)


def test_read_args_returns_only_what_was_set(tmp_path):
    """What the files and overrides set, even to a default's value: train.py tells a given model key
    (which must agree with a checkpoint) from one left at its default."""
    a = write(tmp_path, "a.py", "n_layer = 12\nanchor = 'exo'\n")
    assert read_args([a, "--lr=2"], DEFAULTS) == dict(n_layer=12, anchor="exo", lr=2.0)
    assert read_args([], DEFAULTS) == {}


def test_help_is_read_from_the_comments_next_to_the_defaults(tmp_path):
    path = write(tmp_path, "tool.py", """
x = 1  # not part of DEFAULTS
DEFAULTS = dict(
    # a section comment
    lr=0.01,  # peak learning rate
    out_dir="out#1",  # where '#' in a value is no comment
    seed=42,
)


class Config:
    \"\"\"n_layer = 3  # in a docstring: not a field\"\"\"
    n_layer: int = 3  # transformer blocks, a meaning that goes on
                      # in the column of its own comment
    # a section comment, in another column: not a meaning
    n_head: int = 2  # heads
""")
    assert key_comments(path, "DEFAULTS") == {"lr": "peak learning rate",
                                              "out_dir": "where '#' in a value is no comment"}
    assert key_comments(path, "Config") == {"n_layer": "transformer blocks, a meaning that goes on in the column of "
                                                       "its own comment", "n_head": "heads"}
    keys = dict(lr=0.01, out_dir="out#1", seed=42)
    text = help_text("usage: tool.py", [("keys", keys, key_comments(path, "DEFAULTS"))])
    assert text.splitlines() == ["usage: tool.py", "", "keys:", "  lr = 0.01          peak learning rate",
                                 "  out_dir = 'out#1'  where '#' in a value is no comment", "  seed = 42"]


def test_a_tuple_key_takes_a_list_of_values_or_one(tmp_path):
    defaults = dict(steps=(), name="x")
    (tmp_path / "c.py").write_text("steps = [3, 4]\n")
    assert read_args([str(tmp_path / "c.py")], defaults) == {"steps": (3, 4)}
    assert read_args(["--steps=96,108"], defaults) == {"steps": (96, 108)}
    assert read_args(["--steps=96"], defaults) == {"steps": (96,)}
    with pytest.raises(ValueError, match="steps='a' is str, expected tuple"):
        read_args(["--steps=a"], defaults)
