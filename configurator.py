"""
Poor man's configurator, after nanoGPT. Run from a script as
    exec(open('configurator.py').read())
after the script has set its config globals. It reads sys.argv: plain-Python config files
(`config/baseline.py`) are executed in order, then `--key=value` overrides are applied. Every key must
already exist as a global of the script; values are parsed as Python literals and must keep the
default's type (an int where a float is expected is fine).
"""
import ast
import builtins
import difflib
import sys


def _configure(g, argv):
    known = {k for k, v in g.items() if not k.startswith('_') and isinstance(v, (int, float, bool, str, tuple, list, type(None)))}

    def check_key(key, where):
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else "; see the config section at the top of the script"
            raise SystemExit(f"config error: unknown key '{key}' in {where}{hint}")

    def check_type(key, value, where):
        default = g[key]
        if default is None or value is None or type(value) is type(default):
            return value
        if isinstance(default, float) and type(value) is int:
            return float(value)
        raise SystemExit(f"config error: {key}={value!r} in {where} is a {type(value).__name__}, "
                         f"but {key} is a {type(default).__name__} (default {default!r})")

    for arg in argv:
        if not arg.startswith('--'):
            # a config file: plain Python that assigns globals
            try:
                with open(arg) as f:
                    src = f.read()
            except OSError as e:
                raise SystemExit(f"config error: cannot read config file {arg}: {e.strerror}")
            scope = {}
            exec(builtins.compile(src, arg, 'exec'), {}, scope)  # errors carry the file and line; (train.py has its own 'compile')
            for key, value in scope.items():
                if key.startswith('_') or callable(value) or type(value).__name__ == 'module':
                    continue
                check_key(key, arg)
                g[key] = check_type(key, value, arg)
            print(f"config: {arg}")
        else:
            if '=' not in arg:
                raise SystemExit(f"config error: {arg} should look like --key=value")
            key, text = arg[2:].split('=', 1)  # the value may itself contain '='
            check_key(key, arg)
            try:
                value = ast.literal_eval(text)
            except (SyntaxError, ValueError):
                value = text  # a bare string such as --out_dir=out/run1
            if isinstance(g[key], str) and not isinstance(value, str):
                value = text  # --wandb_run_name=2025 stays a string
            g[key] = check_type(key, value, arg)
            print(f"config: {key} = {g[key]!r}")


_configure(globals(), sys.argv[1:])
