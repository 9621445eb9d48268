"""
nanoGPT-style configuration: `python train.py configs/dyn_exo.py configs/tiny.py --max_steps=100`.
Config files are plain Python assignments (`n_layer = 29`), applied in the order given, then the
`--key=value` overrides. Every key must already have a default, and keeps its type
(a default of None means "auto": any literal is accepted and the program checks it).
"""
import ast
import difflib
import types


def _check(key, value, defaults, source):
    """Return value as the type of defaults[key], or raise a one-line ValueError naming key and source."""
    if key not in defaults:
        close = difflib.get_close_matches(key, defaults, n=3)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise ValueError(f"{source}: unknown key {key!r}{hint}; valid keys: {', '.join(sorted(defaults))}")
    if defaults[key] is None:  # "auto" keys accept any literal; the program checks their values
        return value
    expected = type(defaults[key])
    if expected is float and type(value) is int:
        value = float(value)
    if type(value) is not expected:
        raise ValueError(f"{source}: {key}={value!r} is {type(value).__name__}, expected {expected.__name__} "
                         f"(default {defaults[key]!r})")
    return value


def parse_value(text, default):
    """Text of a --key=value override: strings are taken as written, everything else as a Python literal."""
    if isinstance(default, str):
        return text
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # _check then reports it as a str where something else was expected


def load_config(args, defaults):
    """Apply config files, then --key=value overrides, to a copy of `defaults`; return the result."""
    overrides = {}
    for arg in (a for a in args if a.startswith("--")):  # checked first: a typo costs no file reading
        key, eq, text = arg[2:].partition("=")
        if not eq:
            raise ValueError(f"argument {arg!r}: expected --key=value")
        overrides[key] = _check(key, parse_value(text, defaults.get(key)), defaults, arg)
    config = dict(defaults)
    for path in (a for a in args if not a.startswith("--")):
        try:
            with open(path) as f:
                source = f.read()
        except OSError as e:
            raise ValueError(f"config file {path}: cannot read it ({e.strerror})") from None
        namespace = {}
        exec(compile(source, path, "exec"), {}, namespace)
        for key, value in namespace.items():
            if not key.startswith("_") and not isinstance(value, types.ModuleType):
                config[key] = _check(key, value, defaults, path)
    config.update(overrides)
    return config
