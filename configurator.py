"""
Poor man's configurator, after nanoGPT. Run from a script as
    exec(open('configurator.py').read())
after the script has set its config globals (its "config block": the lines from `# config` to the next
`# -----` line, one `key = default  # meaning` a line). It reads sys.argv: plain-Python config files
(`config/baseline.py`) are executed in order, then `--key=value` overrides are applied, wherever they are typed (a
flag wins over every file); `--help` lists every key with its default and meaning and exits. Every key must be one
of the script's config keys; values are parsed as Python literals and must keep the default's type (an int where a
float is expected is fine). A config file may name the recipe it changes in `_base = 'config/baseline.py'` (a path
from the repository root): that file is applied first, so each file holds only what it changes. Names starting with
'_' are not keys. `read_config_block(path)` gives another script's keys (bench.py takes train.py's), and
`config_files(path)` what a config file sets (study.py reads the experiments with it). The script learns
which keys were set, and where, in `_set_by` ({key: the config file or '--key=value'}) and `_set_at` ({key:
(that file or flag, the file's line or None)}): a value that only happens to equal the default was still chosen
(runkeep/hub.py refuses a chosen model key that contradicts a published checkpoint's config, and takes the
others from it), and config_problems(cfg, _set_at) names the file's line or the flag of a value it refuses.
"""
import ast
import atexit
import builtins
import contextlib
import difflib
import io
import math
import os
import re
import resource
import shlex
import socket
import sys
import threading
import time
import tokenize
import traceback

# a stream closed outright (`>&-`: no file descriptor at all) is None in Python and its first print ends the
# run: it goes to os.devnull instead, so the exit code says how the run ended, whatever its streams
for _fd, _name in ((1, 'stdout'), (2, 'stderr')):
    if getattr(sys, _name) is None:
        os.dup2(os.open(os.devnull, os.O_WRONLY), _fd)
        setattr(sys, _name, open(_fd, 'w', buffering=1, closefd=False))


# -----------------------------------------------------------------------------
# a script's output: a closed stdout or stderr (a pipe whose reader is gone: `| head`, a lost tee, a closed
# SSH session) never stops it, from its first line on (the config lines); a run's rank 0 also copies every
# line to train.log in the run's folder (runkeep's Run)

class LineLog:
    """A log file appended to in whole lines (train.log): a line that does not fit (a full disk) is cut back out
    and the rest of it dropped, and the first line that fits again is preceded by a note of how many are missing;
    never written late when room comes back, after lines said missing. header: a process's header line, which,
    not fitting, is not counted but goes before the next line that fits (where that process's lines begin).
    write() returns what to say on the terminal: ('lost', the error) at the first line left out, ('back', how
    many) when lines fit again; the caller words it. end_note() words the count of lines still missing at the
    output's end, which no note in the file counts."""

    def __init__(self, path):
        # unbuffered: a line that does not fit is known at its write
        self.f, self.name = open(path, 'ab', buffering=0), path
        self.line_start = None  # where the line being written began; None between lines
        self.dropping = False  # the rest of a line that did not fit is dropped: the next line tries again
        self.missing = 0  # lines not in the file since the last one that went in
        self.header = b''  # the header while it has not fit

    def fileno(self):
        return self.f.fileno()

    def flush(self):
        pass  # unbuffered: a stream's flush (the watchdog's, before its stack dump) has nothing to do

    def close(self):
        self.f.close()

    def reopened(self):
        """This log on the file now at its path, which replaced the one open: what this file still owes (the lines
        missing so far, for the note; a header not in yet; the rest of a line being dropped) goes on in that
        one."""
        self.close()
        log = LineLog(self.name)
        log.missing, log.header, log.dropping = self.missing, self.header, self.dropping
        return log

    def end_note(self, whose):
        """At the end of the output: the line to say where its last lines are missing from the file (no line
        fitted after them, so no note there counts them), whose: the output they are of; else ''."""
        return f"note: the last {self.missing} line(s) of {whose} are not in {self.name} (it could not be " \
               "appended to)" if self.missing else ''

    def write(self, data, header=False):
        said = []
        for part in re.findall(rb'[^\n]*\n|[^\n]+', data):
            ends = part.endswith(b'\n')
            if self.dropping:
                self.dropping = not ends
                continue
            note = f"note: {self.missing} line(s) of the output before this one are not in this file (it could " \
                   "not be appended to)\n" if self.missing else ''
            try:
                if self.line_start is None:
                    self.line_start = os.lseek(self.f.fileno(), 0, os.SEEK_END)
                    self.append(self.header + note.encode())
                self.append(part)
            except OSError as e:
                with contextlib.suppress(OSError):  # the part of it that fits: the next line would be glued on
                    if self.line_start is not None:
                        os.ftruncate(self.f.fileno(), self.line_start)
                self.dropping, self.line_start = not ends, None
                if header:
                    self.header += part
                    continue
                if not self.missing:
                    said.append(('lost', e))
                self.missing += 1
                continue
            if ends:  # only a whole line is in: a first part that fits is still cut back out with the rest's
                self.line_start, self.header = None, b''
                if note:
                    said.append(('back', self.missing))
                    self.missing = 0
        return said

    def append(self, data):
        data = memoryview(data)
        while data:  # a write that fits in part returns short; the next one raises
            data = data[self.f.write(data):]


class Tee:
    log = None  # train.log (a LineLog), shared by stdout and stderr
    said = []  # lines about train.log for the terminal, put there after the line being written
    queued = []  # lines from another thread (a stop request's) that came while a line was being written: after it
    lock = threading.RLock()  # a thread's print, or a signal handler's in the middle of one, keeps lines whole
    # train.log when the parent process appends this process's output to it already (study.py names that file
    # in OUTPUT_LOG_VAR): written from here only once the parent's reading end is gone, so each line is there once
    parent_log = None
    OUTPUT_LOG_VAR = 'TRM_OUTPUT_LOG'
    OUTPUT_FROM_VAR = 'TRM_OUTPUT_LOG_FROM'  # where the parent's part for this process begins: its header, then
                                             # this process's output

    def __init__(self, stream):
        self.stream, self.closed_seen, self.part = stream, False, ''

    @classmethod
    def install(cls):
        if not isinstance(sys.stdout, cls):
            sys.stdout, sys.stderr = cls(sys.stdout), cls(sys.stderr)

    @classmethod
    def log_to(cls, path):
        """Rank 0: from now on every line also goes to path (appended: a resumed run adds to it), unless the
        parent appends the output there itself."""
        parent = os.environ.get(cls.OUTPUT_LOG_VAR)
        if parent and os.path.realpath(parent) == os.path.realpath(path):
            cls.parent_log = path
        else:
            cls.open_log(path)

    @classmethod
    def own_part(cls, path):
        """Where the part of the log at path that is this process's begins (a byte offset): the parent's header
        for it, where a parent appends the output there; else None (its end)."""
        parent = os.environ.get(cls.OUTPUT_LOG_VAR)
        if parent and os.path.realpath(parent) == os.path.realpath(path):
            try:
                return int(os.environ[cls.OUTPUT_FROM_VAR])
            except (KeyError, ValueError):
                pass
        return None

    @classmethod
    def open_log(cls, path):
        try:
            cls.log = LineLog(path)
        except OSError as e:
            print(f"warning: cannot write {path} ({e}); the output is not logged there")
            return
        cls.to_log(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {socket.gethostname()} pid {os.getpid()}: "
                   f"{' '.join(sys.argv)}\n", header=True)
        atexit.unregister(cls.at_exit)  # once, whichever log it is
        atexit.register(cls.at_exit)

    @classmethod
    def at_exit(cls):
        """The process's end: lines still missing from train.log are said on stderr's own stream (through the Tee,
        the line would be one more that train.log lacks)."""
        if cls.log is not None and (note := cls.log.end_note('the output')):
            stream = sys.stderr.stream if isinstance(sys.stderr, cls) else sys.stderr
            with contextlib.suppress(OSError, ValueError):
                stream.write(note + '\n')
                stream.flush()

    @classmethod
    def to_log(cls, text, header=False):
        """text appended to train.log in whole lines (LineLog); a line left out says a warning on the terminal, and
        the note when lines fit again follows it there; the run goes on. header: the process's header line, never
        on the terminal."""
        with cls.lock:
            for what, x in cls.log.write(text.encode(errors='backslashreplace'), header):
                cls.said.append(f"warning: could not append to {cls.log.name} ({x.strerror or x}): the output goes on "
                                "here; lines that do not fit there are left out until there is room, then a note "
                                "says how many" if what == 'lost' else
                                f"note: {cls.log.name} is appended to again; {x} line(s) of the output before the "
                                "line above are not in it")
            if cls.queued and cls.log.line_start is None and not cls.log.dropping:
                lines, cls.queued = cls.queued, []
                cls.to_log(''.join(lines))

    @classmethod
    def line_from_thread(cls, line):
        """A line of a thread that must not wait (a stop request's, said at once on the terminal): appended
        whole now, or where a print's parts are being written (its text, then its newline), right after it. A
        thread stuck in a write to train.log holds the lock: then the line is written as it is."""
        if not cls.lock.acquire(timeout=1):
            os.write(cls.log.fileno(), (line + '\n').encode(errors='backslashreplace'))
            return
        try:
            if cls.log.line_start is None and not cls.log.dropping:
                cls.to_log(line + '\n')
            else:
                cls.queued.append(line + '\n')
        finally:
            cls.lock.release()

    def write(self, text):
        # print() writes a line's text and its end in two calls, and torchrun's ranks share one terminal: a line
        # goes out whole, in one write, once its end comes (a part of one, at a flush), so that another rank's
        # line never lands inside it
        with Tee.lock:  # (another thread's print)
            lines, end, self.part = (self.part + text).rpartition('\n')
        if end:
            self._out(lines + end)
        if Tee.log is not None:
            try:
                Tee.to_log(text)
            except ValueError:  # train.log closed (the interpreter's end)
                pass
        if Tee.said and text.endswith('\n') and not self.closed_seen:
            try:
                self.stream.write(''.join(line + '\n' for line in Tee.said))
            except (OSError, ValueError):
                pass
            Tee.said.clear()
        return len(text)

    def flush(self):
        with Tee.lock:
            part, self.part = self.part, ''
        self._out(part)
        if not self.closed_seen:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self.lost()

    def _out(self, text):
        if text and not self.closed_seen:
            try:
                self.stream.write(text)
            except (OSError, ValueError):
                self.lost()

    def lost(self):
        """The reader is gone: what follows goes to train.log only, and the stream's file descriptor to
        /dev/null, so the interpreter's flush at exit cannot fail either."""
        self.closed_seen = True
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
        except (OSError, ValueError):
            pass
        if Tee.parent_log and Tee.log is None:  # the parent no longer copies the output to train.log
            Tee.open_log(Tee.parent_log)

    def __getattr__(self, name):
        return getattr(self.stream, name)

# -----------------------------------------------------------------------------
# torch itself, loaded after the config checks (--help and a config error answer at once)

def import_torch():
    """torch, imported; where an address-space limit (RLIMIT_AS: ulimit -v, prlimit --as) leaves no room for
    torch and the libraries it maps, one line naming the limit instead of the loader's traceback."""
    try:
        import torch
    except (ImportError, OSError, RuntimeError, MemoryError) as e:
        if str(e).startswith('Failed to load the backend extension') and e.__cause__ is not None:
            # a device backend's package (TorchTPU's, of backends/torchtpu.py) that torch's import loads itself
            why = ' '.join(str(e.__cause__).split())[:300] or 'no message'
            name = str(e).partition(': ')[2].partition('. You can')[0]
            raise SystemExit(f"cannot import torch: the device backend {name}, which `import torch` loads, failed "
                             f"({type(e.__cause__).__name__}: {why}): for device='tpu' (TorchTPU) install it again in "
                             "a fresh virtual environment (pip install -r requirements-torchtpu.txt); another device "
                             "runs with TORCH_DEVICE_BACKEND_AUTOLOAD=0 set") from None
        cap = resource.getrlimit(resource.RLIMIT_AS)[0]
        words = ('failed to map', 'bad_alloc', 'allocate memory', 'Cannot allocate', 'out of memory')
        if cap == resource.RLIM_INFINITY or not (isinstance(e, MemoryError) or any(w in str(e) for w in words)):
            raise
        raise SystemExit(f"cannot load torch within this process's address-space limit (RLIMIT_AS {cap / 1e9:.1f} "
                         f"GB, ulimit -v): {' '.join(str(e).split())[:200]}. torch and its libraries map several "
                         "GB at start-up: raise the limit (ulimit -v unlimited) or run where it is larger") from None
    return torch


# -----------------------------------------------------------------------------
# config files and flags

def read_config_block(path, section=None):
    """{key: (default, meaning)} of the config block of the script at `path`, in order. The block is
    plain Python, so it is executed as such; an error names the file and line. section: only the keys under
    the block's `# <section>` heading (solve.py takes train.py's `# model` keys)."""
    with open(path) as f:
        lines = f.read().split('\n')
    start = next((i for i, l in enumerate(lines) if l.startswith('# config')), None)
    if start is None:
        raise SystemExit(f"config error: {path} has no '# config' block")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith('# -----'))
    src = '\n' * start + '\n'.join(lines[start:end])  # keeps line numbers for errors
    scope = {}
    try:  # one namespace, as a module has: a function or comprehension in the block sees the names before it
        exec(builtins.compile(src, path, 'exec'), scope)
    except Exception as e:
        raise SystemExit(f"config error: cannot read the config block of {path}: {type(e).__name__}: {e}")
    meanings, key = {}, None
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type != tokenize.COMMENT:
            key = None if tok.type == tokenize.NAME and tok.start[1] == 0 else key  # a new key's line
            continue
        text, code = tok.string.lstrip('# ').strip(), tok.line[:tok.start[1]].strip()
        if tok.start[1] > 0 and not code and key:  # an indented comment alone on its line: the meaning goes on
            meanings[key] += ' ' + text
        elif (key := code.split('=', 1)[0].strip()).isidentifier():  # a comment after code: its key's meaning
            meanings[key] = text
        else:
            key = None
    keys = [k for k in scope if not k.startswith('_')]
    if section:
        head = next((i for i in range(start, end) if lines[i].split('(')[0].strip() == f'# {section}'), None)
        if head is None:
            raise SystemExit(f"config error: {path} has no '# {section}' heading in its config block")
        stop = next((i for i in range(head + 1, end) if lines[i].startswith('# ')), end)
        keys = [l.split('=', 1)[0].strip() for l in lines[head + 1:stop] if '=' in l]
    return {k: (scope[k], meanings.get(k, '')) for k in keys}


def find_file(path):
    """Where a file a config names is (a _base, a study's builder): the path as written from the working folder,
    else from the repository's root, wherever the command runs."""
    if os.path.exists(path) or os.path.isabs(path):
        return path
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), path)


def file_in_the_way(path):
    """The file where path, a folder to be made, would go (path itself, or the nearest folder above it that is
    there and is a file), or None: the OS's own 'File exists' or 'Not a directory' names no option."""
    up = os.path.abspath(path)
    while not os.path.exists(up):
        up = os.path.dirname(up)
    return None if os.path.isdir(up) else up


def config_files(path, binary_hint='', keys=()):
    """[(file, {key: value})] that a config file applies, in order: its `_base` chain first, then itself.
    binary_hint: said after the typed file's name where that file is not text (a checkpoint typed without its key).
    keys: the script's keys, kept whatever their value (a function or module there is refused by its type, not
    dropped as a helper of the file's is)."""
    chain, typed = [], path
    while path:
        if any(path == p for p, _ in chain):
            raise SystemExit(f"config error: {chain[0][0]} names itself as _base (through {path})")
        named = path  # as the command line or the _base line says it
        path = find_file(path)
        try:
            with open(path) as f:
                src = f.read()
        except OSError as e:
            if not chain:
                raise SystemExit(f"config error: cannot read config file {path}: {e.strerror}")
            said_by = place_words(places(chain[-1][0], ['_base'])['_base'])  # the file to edit, not only the path
            raise SystemExit(f"config error: {said_by}: _base = {named!r}: cannot read config file {path}: "
                             f"{e.strerror} (allowed: a path from the repository root or the working folder)")
        except UnicodeDecodeError:
            raise SystemExit(f"config error: {path} is not a text file, so no config file (one is Python, such as "
                             f"config/quickstart.py){binary_hint if path == typed else ''}")
        scope = {}
        try:  # (builtins.compile: train.py has its own 'compile')
            tree = ast.parse(src, path)
            if not tree.body:  # a run of the defaults (the paper's full recipe) where the file's was meant
                raise SystemExit(f"config error: {path} sets nothing (it is empty or holds only comments: a copy "
                                 "cut short?)")
            if n := bare_annotation(tree):
                raise SystemExit(f"config error: {path}, line {n.lineno}: '{ast.unparse(n)}' sets nothing (a config "
                                 f"file is Python): write {ast.unparse(n.target)} = {ast.unparse(n.annotation)}")
            exec(builtins.compile(tree, path, 'exec'), scope)  # one namespace: its functions see its names
        except SyntaxError as e:
            raise SystemExit(f"config error: {path}, line {e.lineno}: {e.msg}")
        except Exception as e:  # the line of the file where it was raised
            line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__))
                         if f.filename == path), '?')
            raise SystemExit(f"config error: {path}, line {line}: {type(e).__name__}: {e}")
        chain.append((path, scope))
        path = scope.get('_base')
        if path is not None and not isinstance(path, str):  # (True would open file descriptor 1, stdout)
            raise SystemExit(f"config error: {chain[-1][0]}: _base must be a path string, got {type_said(path)}")
    return [(p, {k: v for k, v in scope.items() if not k.startswith('_') and (k in keys or not callable(v)
                 and type(v).__name__ != 'module')}) for p, scope in reversed(chain)]


def bare_annotation(tree):
    """The first `key: value` statement of a config file's own scope (its functions' and classes' left out): an
    annotation, which binds nothing, where `key = value` was meant (a flat YAML file, a typo); None if none."""
    todo = list(tree.body)
    while todo:
        n = todo.pop(0)
        if isinstance(n, ast.AnnAssign) and n.value is None:
            return n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo[:0] = [c for c in ast.iter_child_nodes(n) if isinstance(c, ast.stmt)]
    return None


def places(path, keys):
    """{key: (the config file at `path` as messages name it, the line that assigns the key last, or None)} for
    the keys it sets (a name set where the parser cannot see it, through globals() say, has no line)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    lines = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            lines[n.id] = max(n.lineno, lines.get(n.id, 0))
    return {k: (shown_path(path), lines.get(k)) for k in keys}


def place_words(at):
    """A place of places() (or a flag's: ('--key=value', None)) as a message says it: 'FILE, line N'."""
    where, line = at
    return where + (f", line {line}" if line else '')


def parse_value(text, default):
    """The value of --key=text: a Python literal, else the text itself (a bare string such as out/run1); a
    string key keeps its text (--wandb_run_name=2025 stays '2025')."""
    try:
        value = ast.literal_eval(text)
    except (SyntaxError, ValueError):
        value = text
    return text if isinstance(default, str) and not isinstance(value, str) else value


def parse_flags(text, defaults, where):
    """'--a=1 --b=x' -> {a: 1, b: 'x'} for a script whose keys and defaults are `defaults` (study.py's
    --extra)."""
    out = {}
    for tok in shlex.split(text):
        if not tok.startswith('--') or '=' not in tok:
            raise SystemExit(f"config error: {where}: {tok!r} should look like --key=value")
        k, t = tok[2:].split('=', 1)
        if problem := key_problem(k, where, defaults, {}):
            raise SystemExit(f"config error: {problem}")
        out[k] = parse_value(t, defaults[k])
    return out


def shown_path(path):
    """A config file's path as a message names it: from the working folder when it lies below it."""
    rel = os.path.relpath(path) if os.path.isabs(path) else path
    return path if rel.startswith('..') else rel


def type_said(value):
    """A value's type as a message says it: 'an int', 'a str', 'None'."""
    name = type(value).__name__
    return 'None' if value is None else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def key_problem(key, where, known, renamed, value=None):
    """Why `key`, set in `where` (a config file and its line, or a --key=value flag), is none of a script's keys
    `known`, in one line (renamed: {old key: (its new name, a note)}, its keys of earlier releases); None when it
    is one. Shared by the scripts' flags and files and by the study's experiment files."""
    if key in known:
        return None
    if key in renamed:
        new, note = renamed[key]
        write = f"--{new}={value}" if where.startswith('--') else f"{new} = ..."
        return f"'{key}' in {where} is now called {new}{f' ({note})' if note else ''}: write {write}"
    close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.5)
    return f"unknown key '{key}' in {where}" + (f"; did you mean {', '.join(close)}?" if close else
                                                 "; --help lists every key")


def type_problem(key, value, default, where):
    """Why `value`, set in `where`, cannot be a key whose default is `default`, in one line; None when it can (an
    int where a float is expected can; None only where the default is None: a number's key would crash on it)."""
    if type(value) is float and not math.isfinite(value) and type(default) in (int, float):  # 1e400 reads as inf
        return f"{key}={value!r} in {where} is not a finite number (allowed: finite numbers; default {default!r})"
    if default is None or type(value) is type(default) or isinstance(default, float) and type(value) is int:
        return None
    allowed = 'allowed: True | False; ' if isinstance(default, bool) else ''  # false, 0, yes: Python's spelling
    return (f"{key}={value!r} in {where} is {type_said(value)}, but {key} is {type_said(default)} "
            f"({allowed}default {default!r})")


def _help(g, keys):
    script = g.get('__file__')
    doc = (ast.get_docstring(ast.parse(open(script).read())) or '') if script else ''  # (g's __doc__ is now
                                                                                       # ours)
    if doc:
        print(doc + '\n')
    meanings = {}
    here = os.path.dirname(os.path.abspath(script or 'train.py'))
    for path in (os.path.join(here, 'train.py'), script):  # the trainer's meanings, then the script's own
        if path and os.path.exists(path):
            meanings.update({k: m for k, (_, m) in read_config_block(path).items() if m})
    print("config keys (set in a config file or as --key=value):")
    width = max(len(f"--{k}={g[k]!r}") for k in keys)
    for k in keys:
        print(f"  {f'--{k}={g[k]!r}':<{width}}  {meanings.get(k, '')}")
    raise SystemExit(0)


def _configure(g, argv):
    keys = list(g.get('config_keys') or [k for k, v in g.items() if not k.startswith('_')
                                          and isinstance(v, (int, float, bool, str))])
    known, defaults = set(keys), {k: g[k] for k in keys}  # the script's own defaults, before any flag
    set_by, set_at = g['_set_by'], g['_set_at'] = {}, {}
    if any(a in ('-h', '--help', 'help') for a in argv):
        _help(g, keys)

    renamed = g.get('_renamed') or {}  # {old key: (its new name, a note)}: the script's keys of earlier releases

    def check_key(key, where, value=None):
        if problem := key_problem(key, where, known, renamed, value):
            raise SystemExit(f"config error: {problem}")

    def check_type(key, value, where):  # the value, as its default's type
        if problem := type_problem(key, value, defaults[key], where):
            raise SystemExit(f"config error: {problem}")
        return float(value) if isinstance(defaults[key], float) and type(value) is int else value

    # a flag without '=' first: in `--L_cycles 4` the 4 would otherwise be read as a config file
    if flag := next((a for a in argv if a.startswith('--') and '=' not in a), None):
        raise SystemExit(f"config error: {flag} should look like --key=value (--help lists the keys)")
    # a key typed with one dash, none, or a dash a text editor made of two (en, em): a flag, not a config file's name
    dashes = '-\u2013\u2014'
    if typo := next((a for a in argv if not a.startswith('--') and '=' in a and not os.path.exists(find_file(a))
                     and a.lstrip(dashes).split('=', 1)[0] in known), None):
        key, text = typo.lstrip(dashes).split('=', 1)
        raise SystemExit(f"config error: {typo!r} is no config file: a key is set with two dashes, write "
                         f"--{key}={text}")
    # a puzzle with spaces (a maze's open cells) typed without quotes: the shell's words after it are no config files
    # (a name ending in .py is one, mistyped: said as such below)
    if any(a.startswith('--puzzle=') for a in argv) and 'puzzle' in known and \
            (word := next((a for a in argv if not a.startswith('--') and not a.endswith('.py')
                           and not os.path.exists(find_file(a))), None)):
        raise SystemExit(f"config error: {word!r} is no key and no config file: a --puzzle with spaces (a maze's open "
                         "cells) needs quotes, or the shell cuts it into words: --puzzle='#S  #/...'")
    # the config files in their order, then the flags, wherever they were typed: a flag always wins over a file
    for arg in sorted(argv, key=lambda a: a.startswith('--')):
        if not arg.startswith('--'):
            # a config file: plain Python that assigns globals (after its _base file's)
            hint = f"; a checkpoint is given as --init_from={arg}" if 'init_from' in known else ''
            for path, keys in config_files(arg, hint, known):
                at = places(path, keys)
                for key, value in keys.items():
                    check_key(key, place_words(at[key]))
                    g[key] = check_type(key, value, place_words(at[key]))
                    set_by[key], set_at[key] = at[key][0], at[key]
                print(f"config: {shown_path(path)}")
        else:
            key, text = arg[2:].split('=', 1)  # the value may itself contain '='
            check_key(key, arg, text)
            g[key] = check_type(key, parse_value(text, g[key]), arg)
            set_by[key], set_at[key] = arg, (arg, None)
            print(f"config: {key} = {g[key]!r}")


# -----------------------------------------------------------------------------
# the allowed values of train.py's keys: train.py checks its config with them before anything runs, solve.py the
# model keys it takes, runkeep/hub.py those of an all_config.yaml (a value from a file passes the same rules as
# one typed on a command line)

_pos, _nonneg = (lambda v: v > 0, '> 0'), (lambda v: v >= 0, '>= 0')
_unit = (lambda v: 0 <= v < 1, 'in [0, 1)')
_one_of = lambda *a: (lambda v: v in a, ' | '.join(map(repr, a)))
_range = lambda v: v == '' or (v.count(':') == 1 and all(p.isascii() and p.isdigit() for p in v.split(':'))
                               and int(v.split(':')[0]) < int(v.split(':')[1]))
# train.py's and bench.py's key kernels (device.choose_kernels)
KERNELS = ('auto', 'off', 'mlp_t', 'cudnn', 'gated', 'quack', 'triton')
_out = lambda v: bool(v.strip()) and not (v.startswith('gs://') and not v[len('gs://'):].partition('/')[0])
TRAIN_RULES = dict(out_dir=(_out, 'a folder or gs://BUCKET/prefix, not empty'),
             eval_every_epochs=_pos, eval_subset=_nonneg, eval_steps=_nonneg, eval_views=_pos,
             eval_batch_size=_nonneg, log_interval=_pos, checkpoint_interval=_nonneg, keep_last_n=_nonneg,
             global_batch_size=_pos, epochs=_pos, max_steps=_nonneg, max_minutes=_nonneg, seed=_nonneg,
             hidden_size=_pos, num_heads=_pos, expansion=_pos, L_layers=_pos, H_cycles=_pos, L_cycles=_pos,
             halt_max_steps=_pos, halt_exploration_prob=(lambda v: 0 <= v <= 1, 'a probability in [0, 1]'),
             pos_encodings=_one_of('rope', 'learned', 'none'), puzzle_emb_ndim=_nonneg, puzzle_emb_len=_pos,
             forward_dtype=_one_of('auto', 'bfloat16', 'float16', 'float32'), rms_norm_eps=_pos,
             rope_theta=_pos, mlp_multiple=_pos, loss_type=_one_of('stablemax', 'softmax'),
             loss_dtype=_one_of('auto', 'float64', 'float32'),
             lr=_pos, lr_min_ratio=(lambda v: 0 <= v <= 1, 'in [0, 1]'), lr_warmup_steps=_nonneg,
             beta1=_unit, beta2=_unit, weight_decay=_nonneg, puzzle_emb_lr=_nonneg,
             puzzle_emb_weight_decay=_nonneg, ema_rate=_unit, grad_clip=_nonneg,
             gradient_accumulation_steps=_pos, kernels=_one_of(*KERNELS),
             device=_one_of('auto', 'cpu', 'cuda', 'xla', 'tpu'), gcs_retries=_pos, watchdog_minutes=_nonneg,
             preflight_phase=_one_of(0, 1, 2), profile_steps=(_range, "'' or 'START:END' with 0 <= START < END"),
             # W&B's own rule for a project's name: one it refuses leaves the run without W&B
             wandb_project=(lambda v: len(v) <= 128 and not set(v) & set('/\\#?%:'),
                            "at most 128 characters, none of / \\ # ? % :"))


def fail(message):
    """A user error: one line (its whitespace folded), no traceback."""
    raise SystemExit(' '.join(str(message).split()))


def set_where(set_at, keys):
    """', from FILE, line N and --key=value': where set_at (a script's _set_at) says these keys were set, ''
    where it names none of them."""
    found = {}
    for source, line in (set_at[k] for k in keys if k in set_at):
        found.setdefault(source, []).extend([line] if line else [])

    def place(path, lines):  # 'FILE', 'FILE, line N' or 'FILE, lines N, M'
        return path + (f", line{'s' if len(lines) > 1 else ''} {', '.join(map(str, sorted(lines)))}" if lines else '')
    flags = ' '.join(w for w in found if w.startswith('--'))  # as typed on the command line
    said = [place(w, at) for w, at in found.items() if not w.startswith('--')] + ([flags] if flags else [])
    return f", from {' and '.join(said)}" if said else ''


def config_problems(cfg, set_at=None):
    """The values of cfg (any of train.py's keys) that break a rule, each as 'key=value (allowed: ...)', then
    the keys of the model's shape that contradict each other (checked only where each of them is allowed);
    with set_at (the script's _set_at), each names the config file's line or the flag that set its keys."""
    set_at = set_at or {}
    broken = {k for k, (ok, _) in TRAIN_RULES.items() if k in cfg and not ok(cfg[k])}
    bad = [f"{k}={cfg[k]!r} (allowed: {TRAIN_RULES[k][1]}){set_where(set_at, [k])}" for k in TRAIN_RULES
           if k in broken]
    usable = lambda *keys: all(k in cfg and k not in broken for k in keys)
    if usable('puzzle_emb_ndim', 'puzzle_emb_len', 'hidden_size') and \
            cfg['puzzle_emb_ndim'] > cfg['puzzle_emb_len'] * cfg['hidden_size']:
        bad.append(f"puzzle_emb_ndim={cfg['puzzle_emb_ndim']} does not fit in puzzle_emb_len * hidden_size = "
                   f"{cfg['puzzle_emb_len']} * {cfg['hidden_size']}: lower it or raise puzzle_emb_len"
                   + set_where(set_at, ['puzzle_emb_ndim', 'puzzle_emb_len', 'hidden_size']))
    attention = usable('mlp_t', 'hidden_size', 'num_heads') and not cfg['mlp_t']
    if attention and cfg['hidden_size'] % cfg['num_heads']:
        bad.append(f"hidden_size={cfg['hidden_size']} is not divisible by num_heads={cfg['num_heads']} "
                   "(attention: mlp_t=False)" + set_where(set_at, ['mlp_t', 'hidden_size', 'num_heads']))
    elif attention and usable('pos_encodings') and cfg['pos_encodings'] == 'rope' and \
            cfg['hidden_size'] // cfg['num_heads'] % 2:  # RoPE rotates each head's channels in pairs
        bad.append(f"hidden_size={cfg['hidden_size']} / num_heads={cfg['num_heads']} = "
                   f"{cfg['hidden_size'] // cfg['num_heads']} channels a head: RoPE (pos_encodings='rope', "
                   "attention: mlp_t=False) rotates them in pairs (allowed: an even hidden_size / num_heads, or "
                   "pos_encodings 'learned' | 'none')"
                   + set_where(set_at, ['mlp_t', 'pos_encodings', 'hidden_size', 'num_heads']))
    return bad


if __name__ != 'configurator':  # exec'd by a script (imported as a module, it only lends read_config_block)
    # a closed stdout never stops the script, from its first line on: the Tee of configurator imported as a module,
    # the one class that the run's records (runkeep) hand train.log to
    from configurator import Tee as _Tee
    _Tee.install()
    _configure(globals(), sys.argv[1:])
