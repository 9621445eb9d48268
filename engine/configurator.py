"""
nanoGPT-style configuration: `python train.py configs/dyn_exo.py configs/tiny.py --max_steps=100`.
Config files are plain Python assignments (`n_layer = 29`), applied in the order given, then the
`--key=value` overrides. Every key must already have a default, and keeps its type
(a default of None means "auto": any literal is accepted and the program checks it; a tuple key takes
`--key=96,108`, one value, or a list).

`--help` text is made from the comments next to the defaults (`key=value,  # meaning`), so a key and
its meaning are written once, in one line.
"""
import ast
import difflib
import io
import tokenize
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
    if expected is tuple and type(value) in (int, list):  # --steps=96 is (96,); a config file's list, a tuple
        value = tuple(value) if type(value) is list else (value,)
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


def read_args(args, defaults):
    """The keys that config files, then --key=value overrides, set (a later setting wins), each checked
    against `defaults`; keys left at their default are absent. load_config adds the defaults."""
    overrides = {}
    for arg in (a for a in args if a.startswith("--")):  # checked first: a typo costs no file reading
        key, eq, text = arg[2:].partition("=")
        if not eq:
            raise ValueError(f"argument {arg!r}: expected --key=value")
        overrides[key] = _check(key, parse_value(text, defaults.get(key)), defaults, arg)
    given = {}
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
                given[key] = _check(key, value, defaults, path)
    given.update(overrides)
    return given


def load_config(args, defaults):
    """Apply config files, then --key=value overrides, to a copy of `defaults`; return the result."""
    return {**defaults, **read_args(args, defaults)}


def wants_help(args):
    return any(a in ("-h", "--help") for a in args)


def key_comments(path, name):
    """{key: meaning} from the Python file `path`: the trailing comment of each line of the top-level
    assignment or class `name` that reads `key=value,  # meaning`, `key = value  # meaning` or
    `key: type = value  # meaning` (a dict(...) of defaults, a dataclass). A meaning goes on over the comment lines
    right below whose `#` stands in the same column as its own."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    node = next(n for n in ast.parse(source).body if name == getattr(n, "name", None) or
                any(getattr(t, "id", None) == name for t in getattr(n, "targets", ())))
    segment = "".join(source.splitlines(keepends=True)[node.lineno - 1:node.end_lineno])
    rows = {}
    for tok in tokenize.generate_tokens(io.StringIO(segment).readline):
        if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            rows.setdefault(tok.start[0], []).append(tok)
    meanings, last = {}, None  # last: the key whose meaning a comment line below may go on with, and its column
    for toks in rows.values():
        if (len(toks) >= 3 and toks[0].type == tokenize.NAME and toks[1].string in ("=", ":")
                and toks[-1].type == tokenize.COMMENT):
            meanings[toks[0].string] = toks[-1].string.lstrip("#").strip()
            last = toks[0].string, toks[-1].start[1]
        elif last and len(toks) == 1 and toks[0].type == tokenize.COMMENT and toks[0].start[1] == last[1]:
            meanings[last[0]] += " " + toks[0].string.lstrip("#").strip()  # a comment line under the key's own
        else:
            last = None
    return meanings


def help_text(intro, sections):
    """`intro`, then per (title, defaults, meanings) section one line per key: key = default  meaning."""
    lines = [intro.strip(), ""]
    for title, defaults, meanings in sections:
        lines.append(f"{title}:")
        width = max(len(f"{k} = {v!r}") for k, v in defaults.items())
        lines += [f"  {f'{k} = {v!r}':<{width}}  {meanings.get(k, '')}".rstrip() for k, v in defaults.items()]
        lines.append("")
    return "\n".join(lines).rstrip()
