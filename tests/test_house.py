"""
The house rules a forker relies on: one source of defaults (train.py's config block and TRMConfig agree; --help
is the table of keys), --help for every script, the kernel at the root (scripts above libraries in the import
graph) and the shell in packages, train.py reaching the shell through its front only, no pointer to a file outside
the repository, a README that is a front door with every link resolving, and the number format chosen by the
hardware.
    python -m pytest -q tests/test_house.py
"""
import ast
import dataclasses
import fnmatch
import functools
import os
import re
import shlex

import pytest

from conftest import ROOT, run
from configurator import config_files, read_config_block
from device import choose_dtype
from model import MODEL_CHOICES, TRMConfig

SCRIPTS = ['train.py', 'bench.py', 'solve.py', 'study.py', 'prepare_sudoku.py', 'prepare_maze.py', 'prepare_arc.py',
           'publish.py']
KERNEL = ['model.py', 'step.py', 'data.py', 'evaluate.py', 'arc.py', 'puzzles.py', 'device.py', 'configurator.py']
# beside the kernel: the accelerators' own code; the shell (run keeping); the study runner's libraries
PACKAGES = ['backends', 'runkeep', 'studies']
LIBRARIES = KERNEL + [os.path.join(p, f) for p in PACKAGES for f in sorted(os.listdir(os.path.join(ROOT, p)))
                      if f.endswith('.py')]


@functools.cache
def script_help(script):
    """A script's --help, run once for the whole file."""
    return run([script, '--help']).stdout


CONFIG_KEYS = 'config keys (set in a config file or as --key=value):'  # configurator.py's heading of the keys


def train_defaults():
    return {k: v for k, (v, _) in read_config_block(os.path.join(ROOT, 'train.py')).items()}


def test_trmconfig_defaults_are_the_trainers():
    d = train_defaults()
    for f in dataclasses.fields(TRMConfig):
        if f.name in ('vocab_size', 'seq_len', 'num_puzzle_identifiers'):
            continue  # from the dataset
        if f.name in ('forward_dtype', 'loss_dtype') and d[f.name] == 'auto':
            continue  # the trainer resolves 'auto' for the hardware (tested below)
        assert f.default == d[f.name], (f.name, f.default, d[f.name])


def test_the_loss_skips_the_label_the_loader_writes_for_ignored_cells():
    # model.py holds its own copy (the network imports nothing of the trainer's); the two must agree
    import data
    import model
    assert model.IGNORE_LABEL_ID == data.IGNORE_LABEL_ID == -100


def test_the_root_holds_the_kernel_and_the_shell_is_in_packages():
    root = sorted(f for f in os.listdir(ROOT) if f.endswith('.py'))
    assert root == sorted(SCRIPTS + [f for f in KERNEL if os.path.exists(os.path.join(ROOT, f))] + ['test_smoke.py'])
    assert len(root) <= 18, root


def test_train_py_reaches_the_shell_through_its_front_alone():
    """train.py imports the kernel's libraries and runkeep's front (tell_other_hosts_if_ending_early,
    resolve_init_from, Run, launch, start_worker) alone, and reads no member of Run's parts."""
    tree = ast.parse(open(os.path.join(ROOT, 'train.py')).read())
    kernel = {f[:-3] for f in KERNEL}
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    project = {m for m in modules if m.split('.')[0] in kernel | {'runkeep', 'studies'}}
    assert project - kernel == {'runkeep'}, project - kernel
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and getattr(n.value, 'id', '') == 'runkeep'}
    assert used <= {'Run', 'launch', 'start_worker', 'resolve_init_from', 'tell_other_hosts_if_ending_early'}, used
    reached = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)
               and isinstance(n.value, ast.Attribute) and getattr(n.value.value, 'id', '') == 'run']
    assert not reached, reached  # run.budget.plan, run.clock.loop_start, ...: Run's parts are its own


def test_the_scripts_allow_the_model_s_choices():
    """train.py and solve.py check their keys before they import torch: their allowed values of a model key
    are TRMConfig's, after what the script resolves itself ('auto', 'checkpoint')."""
    own = {('train.py', 'forward_dtype'): ['auto'], ('train.py', 'loss_dtype'): ['auto'],
           ('solve.py', 'forward_dtype'): ['checkpoint', 'auto']}
    for script, keys in (('train.py', list(MODEL_CHOICES)), ('solve.py', ['pos_encodings', 'forward_dtype'])):
        for k in keys:
            p = run([script, f'--{k}=nonsense'], check=False)
            allowed = re.search(rf"{k}='nonsense' \(allowed: ([^)]*)\)", p.stderr)
            assert p.returncode == 1 and allowed, (script, k, p.stderr)
            assert [ast.literal_eval(v) for v in allowed.group(1).split(' | ')] == \
                own.get((script, k), []) + list(MODEL_CHOICES[k]), (script, k, allowed.group(1))
    with pytest.raises(ValueError, match="pos_encodings='alibi': allowed 'rope', 'learned', 'none'"):
        TRMConfig(pos_encodings='alibi')

def test_config_files_hold_only_what_they_change_and_their_base_comes_first(tmp_path):
    d = train_defaults()
    for name in ('baseline', 'maze', 'sudoku_att', 'quickstart', 'sudoku_tta', 'maze_quickstart', 'arc_twin'):
        for path, keys in config_files(os.path.join(ROOT, 'config', name + '.py')):
            repeated = [k for k in keys if keys[k] == d[k] and k not in ('data_path', 'out_dir')]
            assert not repeated, (path, repeated)  # a default written again is a second source of it
    assert [os.path.basename(p) for p, _ in config_files(os.path.join(ROOT, 'config/sudoku_att.py'))] == \
        ['baseline.py', 'sudoku_att.py']
    base, cfg = tmp_path / 'base.py', tmp_path / 'run.py'
    base.write_text("hidden_size = 128\nL_cycles = 2\n")
    cfg.write_text(f"_base = {str(base)!r}\nL_cycles = 4\n")
    assert config_files(str(cfg)) == [(str(base), dict(hidden_size=128, L_cycles=2)), (str(cfg), dict(L_cycles=4))]
    base.write_text("lr = 1e-3\nhidden_sise = 128\n")  # a typo in the base is named with the base's path and line
    p = run(['train.py', str(cfg)], check=False)
    assert p.returncode == 1 and f"unknown key 'hidden_sise' in {base}, line 2; did you mean hidden_size" in p.stderr, \
        p.stderr
    base.write_text(f"_base = {str(cfg)!r}\n")
    p = run(['train.py', str(cfg)], check=False)
    assert p.returncode == 1 and 'names itself as _base' in p.stderr and 'Traceback' not in p.stderr, p.stderr
    cfg.write_text("_base = 'config/no_such_recipe.py'\n")
    p = run(['train.py', str(cfg)], check=False)
    assert p.returncode == 1 and 'cannot read config file' in p.stderr and 'no_such_recipe.py' in p.stderr, p.stderr



# the reference README's training commands over its config/cfg_pretrain.yaml and config/arch/trm.yaml (ARC's:
# tests/test_arc_train.py); these files take most of them from train.py's defaults, which must not drift
PAPER_COMMON = dict(hidden_size=512, num_heads=8, expansion=4.0, L_layers=2, H_cycles=3, halt_max_steps=16,
                    halt_exploration_prob=0.1, puzzle_emb_ndim=512, puzzle_emb_len=16, no_ACT_continue=True,
                    loss_type='stablemax', global_batch_size=768, epochs=50000, eval_every_epochs=5000, lr=1e-4,
                    lr_min_ratio=1.0, lr_warmup_steps=2000, beta1=0.9, beta2=0.95, weight_decay=1.0,
                    puzzle_emb_lr=1e-4, puzzle_emb_weight_decay=1.0, ema=True, ema_rate=0.999, grad_clip=0.0,
                    seed=0)
PAPER = {'baseline': dict(PAPER_COMMON, L_cycles=6, mlp_t=True, pos_encodings='none',
                          data_path='data/sudoku-extreme-1k-aug-1000'),
         'sudoku_att': dict(PAPER_COMMON, L_cycles=6, mlp_t=False, pos_encodings='rope',
                            data_path='data/sudoku-extreme-1k-aug-1000'),
         'maze': dict(PAPER_COMMON, L_cycles=4, mlp_t=False, pos_encodings='rope',
                      data_path='data/maze-30x30-hard-1k')}


def test_the_sudoku_and_maze_configs_hold_the_reference_commands():
    for name, paper in PAPER.items():
        recipe = train_defaults()
        for _, keys in config_files(os.path.join(ROOT, 'config', name + '.py')):
            recipe.update(keys)
        assert {k: recipe[k] for k in paper} == paper, (name, {k: recipe[k] for k in paper if recipe[k] != paper[k]})


def test_every_recipe_with_a_puzzle_embedding_gives_it_the_model_s_width():
    # the reference's puzzle_emb_ndim is ${.hidden_size}: a width study's point is that model at that width, not a
    # 512-wide table spread over two prefix tokens at 256 or half of one token at 1024
    untied = {}
    for folder in ('config', 'config/study', 'config/adapt'):
        for f in sorted(os.listdir(os.path.join(ROOT, folder))):
            if f.endswith('.py'):
                recipe = train_defaults()
                for _, keys in config_files(os.path.join(ROOT, folder, f)):
                    recipe.update(keys)
                if recipe['puzzle_emb_ndim'] not in (0, recipe['hidden_size']):
                    untied[f'{folder}/{f}'] = (recipe['hidden_size'], recipe['puzzle_emb_ndim'])
    assert untied == {}

def test_every_config_key_has_a_meaning_and_help_lists_it_with_its_default():
    block = read_config_block(os.path.join(ROOT, 'train.py'))
    assert [k for k, (_, m) in block.items() if not m] == []
    for args in (['train.py', '--help'], ['train.py', '-h'], ['bench.py', '--help']):
        out = script_help(args[0]) if args[1] == '--help' else run(args).stdout
        for k, (v, meaning) in block.items():  # bench.py lists train.py's keys too, some with its own defaults
            assert (f"--{k}={v!r}" if args[0] == 'train.py' else f"--{k}=") in out, (args, k)
    assert "--L_cycles=6  " in script_help('train.py') and "n: z-updates per round" in script_help('train.py')


def test_every_key_a_scripts_help_lists_is_one_of_its_config_keys_with_a_meaning():
    # a name the script imports (a constant of a library) must not become a key a flag could set
    for script in ('train.py', 'bench.py', 'solve.py', 'study.py', 'publish.py'):
        listed = script_help(script).partition(CONFIG_KEYS)[2].strip('\n')
        assert listed, script
        blank = [line.split('=')[0].strip() for line in listed.splitlines()
                 if not re.match(r'\s*--\w+=.*\S\s{2,}\S', line)]
        assert blank == [], (script, blank)
    p = run(['study.py', '--ENDED=x'], check=False)
    assert p.returncode == 1 and "unknown key 'ENDED'" in p.stderr, p.stderr


def imports_of(path):
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split('.')[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split('.')[0])
    return names


def test_scripts_sit_above_libraries_and_import_no_script():
    scripts = {s[:-3] for s in SCRIPTS}
    for f in SCRIPTS + LIBRARIES:
        if os.path.exists(os.path.join(ROOT, f)):
            assert not imports_of(f) & scripts, (f, imports_of(f) & scripts)
    # tests may import the builders' functions (they run only under __main__), never a script that runs on import
    for f in ['test_smoke.py'] + ['tests/' + t for t in os.listdir(os.path.join(ROOT, 'tests')) if t.endswith('.py')]:
        assert not imports_of(f) & {'train', 'bench', 'solve', 'study'}, f


def backend_calls(path):
    """What of a device backend's API a file's code uses: torch_xla and torch.distributed by their imports, CUDA's
    by torch.cuda (TorchTPU's: tests/test_torchtpu.py)."""
    uses = set()
    for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        uses |= {m for m in ('torch_xla', 'torch.distributed') for n in modules if n == m or n.startswith(m + '.')}
        if isinstance(node, ast.Attribute) and node.attr == 'cuda' and getattr(node.value, 'id', '') == 'torch':
            uses.add('torch.cuda')
    return uses


def test_every_backend_call_lives_in_device_py_and_backends():
    """A forker who adds a device, or moves to another torch_xla, edits device.py and backends/ alone. What stays
    outside, and why: step.py's XLA form of the training step and its torch.compile backend (all of torch.compile's
    use is in step.py); bench.py's split of an XLA step into the host's and the device's time (it wraps torch_xla's
    graph runner)."""
    outside = {'step.py': {'torch_xla'}, 'bench.py': {'torch_xla'}}
    files = [f for f in SCRIPTS + LIBRARIES + ['test_smoke.py'] if f != 'device.py' and not f.startswith('backends')]
    assert {f: u for f in files if (u := backend_calls(f))} == outside
    assert backend_calls('device.py') == {'torch_xla', 'torch.distributed', 'torch.cuda'}  # the test sees them


def test_the_order_the_workers_take_the_test_files_in_names_existing_files():
    from conftest import LONGEST_FIRST  # a file renamed or removed would silently lose its place
    files = set(os.listdir(os.path.join(ROOT, 'tests'))) | set(os.listdir(ROOT))
    assert [f for f in LONGEST_FIRST if f not in files] == []


DOCS = ['README.md'] + sorted('docs/' + f for f in os.listdir(os.path.join(ROOT, 'docs')) if f.endswith('.md'))
LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)\)')
FENCE = re.compile(r'(?ms)^```(\w*)\n(.*?)^```')  # a fenced block: its language, its text


def prose(path):
    """A page without its fenced blocks."""
    return FENCE.sub('', open(path).read())


def test_no_comment_points_outside_the_repository():
    for f in SCRIPTS + LIBRARIES + DOCS:
        if os.path.exists(os.path.join(ROOT, f)):
            assert 'TRM_SPEC' not in open(os.path.join(ROOT, f)).read(), f
    # a command a user copies (a guide's, a config's, one the study runs) names no folder beside the checkout
    configs = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ROOT, 'config'))
               for f in fs if f.endswith('.py')]
    pages = [os.path.join(ROOT, f) for f in SCRIPTS + LIBRARIES + DOCS if f != 'docs/log.md']
    assert [f for f in pages + configs if os.path.exists(f) and '../shared' in open(f).read()] == []


def anchors(path):
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r'[^\w\- ]', '', h.strip().lower()).replace(' ', '-')
            for h in re.findall(r'(?m)^#{1,6} (.*)$', prose(path))}


def test_every_relative_link_in_the_docs_resolves():
    broken = []
    for page in DOCS:
        for target in LINK.findall(prose(os.path.join(ROOT, page))):
            if re.match(r'[a-z]+:', target):
                continue  # https://..., a page outside the repository
            file, _, anchor = target.partition('#')
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), file)) if file \
                else os.path.join(ROOT, page)
            if not os.path.isfile(path):
                broken.append(f"{page}: {target} (no such file)")
            elif anchor and path.endswith('.md') and anchor not in anchors(path):
                broken.append(f"{page}: {target} (no such heading)")
    assert not broken, broken
    linked = {os.path.basename(t) for page in DOCS for t in LINK.findall(open(os.path.join(ROOT, page)).read())}
    unlinked = [f for f in os.listdir(os.path.join(ROOT, 'docs')) if f.endswith('.png') and f not in linked]
    assert not unlinked, unlinked  # a picture that no page shows


def shell_words(text):
    """text's words as the shell splits them, its operators (&&, |, ;, >, <) words of their own and a comment
    dropped; a <placeholder> stays in its word."""
    lexer = shlex.shlex(re.sub(r'<([\w.-]+)>', '\u2039\\1\u203a', text), posix=True, punctuation_chars='&|;<>')
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:  # a quote an inline span cut
        return text.split()


def commands_in(text):
    """(script, its words) of each command in a line of shell that runs a file of the repository's: the word
    after python/torchrun/bash (their own flags and VAR=value words between), or a script of SCRIPTS that starts
    the line; a quoted word with a command in it (ssh's --command="...", CMD="...") is read as shell."""
    words = shell_words(text) + [';']
    start = 0
    for end, word in enumerate(words):
        if word and set(word) <= set('&|;<>'):
            part = words[start:end - (word[0] == '>' and words[end - 1].isdigit())]  # 2>&1: the 2 is the stream's
            for i, w in enumerate(part):
                if ' ' in w:
                    yield from commands_in(re.sub(r'^[\w-]*=', '', w))
                elif re.search(r'\.(py|sh)$', w):
                    runner = [b for b in part[:i] if not re.match(r'-|\w+=', b)][-1:]
                    if runner and re.fullmatch(r'(\S*/)?(python[\d.]*|torchrun|bash|sh)', runner[0]) \
                            or i == 0 and fnmatch.filter(SCRIPTS, w):
                        yield w, part[i + 1:]
                        break
            start = end + 1


def guide_commands():
    """(page, command, script, its words) of every command in the guides: each line of a fenced block but a
    ```python one (a \\ at a line's end goes on on the next), and each inline code span."""
    for page in DOCS:
        if page == 'docs/log.md':
            continue
        text = open(os.path.join(ROOT, page)).read()
        lines = [line for lang, block in FENCE.findall(text) if lang != 'python'
                 for line in block.replace('\\\n', ' ').splitlines()]
        for line in lines + re.findall(r'`([^`]+)`', prose(os.path.join(ROOT, page))):
            for script, words in commands_in(line):
                yield page, ' '.join(line.split()), script, words


def script_flags(script):
    """{flag: whether it takes a value} of a script: configurator.py's scripts the keys their --help lists (as
    --key=value alone), argparse's (prepare_*.py) the options of their usage line."""
    text = script_help(script)
    if CONFIG_KEYS in text:
        return {k: True for k in re.findall(r'(?m)^  --(\w+)=', text.partition(CONFIG_KEYS)[2])}
    return {k: bool(v) for k, v in re.findall(r'--(\w+)( [A-Z{][^\s\]]*)?', text.split('\n\n')[0])}


def test_every_command_in_the_guides_runs_as_written():
    """A command a newcomer copies from a guide names a script that is there, config files that are there and
    flags its script takes: train.py, bench.py, solve.py, study.py and publish.py take --key=value of a key their
    --help lists (configurator.py refuses --key value), prepare_*.py the options of their --help, with a value
    after those that take one and none after a switch (--aug).
    The guides' placeholders pass, by these rules: a value is not checked (CKPT, OWNER/REPO, path/to/..., N, M, K),
    but a config file's path (config/...py); a word in [] is an optional part, checked as the rest; `...` and a
    word with a <placeholder> in it stand for what the reader fills in; --key=value is the guides' name for any
    key; a script named with a * (prepare_*.py) is each script it matches. A flag is written in full (argparse
    would take a prefix of it)."""
    wrong = []
    for page, line, script, words in guide_commands():
        scripts = fnmatch.filter(SCRIPTS, script) if '*' in script else [script]
        if not scripts or not all(os.path.isfile(os.path.join(ROOT, s)) for s in scripts):
            wrong.append(f"{page}: {line}: no script {script}")
        words = [w.strip('[]') for w in words if w.strip('[]') not in ('', '...')]
        for w in words:
            path = w.rpartition('=')[2] if w.startswith('-') else w
            if re.fullmatch(r'config/[\w/.-]+\.py', path) and not os.path.isfile(os.path.join(ROOT, path)):
                wrong.append(f"{page}: {line}: no config file {path}")
        for s in (s for s in scripts if s in SCRIPTS):
            flags, keys, value = script_flags(s), CONFIG_KEYS in script_help(s), False
            for w in words:
                flag, eq, _ = w.lstrip('-').partition('=')
                if w in ('-h', '--help', '--key=value'):
                    continue
                if not w.startswith('-'):
                    if not (value or keys or '\u2039' in w):  # (configurator's: a config file; a <placeholder>)
                        wrong.append(f"{page}: {line}: {s} takes no word {w!r} here")
                elif not w.startswith('--') or flag not in flags:
                    wrong.append(f"{page}: {line}: {s} has no flag {w.partition('=')[0]}")
                elif keys and not eq:
                    wrong.append(f"{page}: {line}: {s} takes --{flag}=VALUE, not --{flag} VALUE")
                elif eq and not flags[flag]:
                    wrong.append(f"{page}: {line}: {s}'s --{flag} is a switch: it takes no value")
                value = w.startswith('-') and not eq and flags.get(flag, True)  # an unknown flag's: no word of its own
    assert wrong == [], '\n'.join(wrong)


def test_the_docs_are_guides_and_the_log_is_the_notebook():
    """Each guide answers its question and points to its evidence in docs/log.md; the dated figures grow the log."""
    size = {page: len(open(os.path.join(ROOT, page)).read()) for page in DOCS if page != 'docs/log.md'}
    assert [p for p, n in size.items() if n > 25000] == [], size
    assert sum(size.values()) < 160000, sum(size.values())


def test_the_readme_is_a_front_door():
    readme = open(os.path.join(ROOT, 'README.md')).read()
    assert len(readme) <= 15000, len(readme)
    ci = [l for l in open(os.path.join(ROOT, '.ci/run')).read().splitlines() if l.startswith('python -m pytest')]
    first = readme.splitlines()[:80]
    assert ci and any(l.endswith('&& ' + ci[0]) or l == ci[0] for l in first), ci  # CI runs what the README says
    assert any('python -m pytest -q test_smoke.py' in l for l in first)  # the one-minute check
    assert not re.search(r'\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b', readme)  # no commit hash


def test_the_test_requirements_install_on_macos_without_torch_xla():
    """README: on macOS all but the XLA parts run. torch_xla has Linux wheels only: a requirement of it that applies
    there stops `pip install -r requirements-test.txt` at 'No matching distribution found', and no test runs."""
    from packaging.requirements import Requirement
    lines = [l.split('#')[0].strip() for l in open(os.path.join(ROOT, 'requirements-test.txt'))]
    reqs = [Requirement(l) for l in lines if l and not l.startswith('-r')]
    on = {system: {r.name for r in reqs if r.marker is None or r.marker.evaluate(
        dict(sys_platform=system.lower(), platform_system=system))} for system in ('Linux', 'Darwin')}
    assert 'torch_xla' in on['Linux'] and on['Darwin'] == on['Linux'] - {'torch_xla'}, on


@pytest.mark.parametrize('requested,kind,cap,native,want,why', [
    ('auto', 'cuda', (9, 0), None, 'bfloat16', 'compute capability 9.0'),   # H100
    ('auto', 'cuda', (7, 5), None, 'float32', 'compute capability 7.5'),    # T4: no native bf16
    ('auto', 'cpu', None, True, 'bfloat16', 'with native bf16'),
    ('auto', 'cpu', None, False, 'float32', 'without native bf16'),
    ('bfloat16', 'cpu', None, False, 'bfloat16', 'emulated'),  # obeyed, with a warning of its own
    ('bfloat16', 'cuda', (7, 0), None, 'bfloat16', 'emulated'),
    ('float32', 'cuda', (9, 0), None, 'float32', 'as configured'),
])
def test_the_number_format_is_chosen_by_the_hardware(requested, kind, cap, native, want, why):
    dtype, text, warning = choose_dtype(requested, kind, cuda_capability=cap, native_cpu_bf16=native)
    assert dtype == want and why in text and not text.startswith('warning'), (dtype, text)
    assert warning.startswith('warning: forward_dtype=bfloat16 on a ') if why == 'emulated' else warning == ''


def test_the_number_format_on_a_tpu_is_bfloat16(monkeypatch):
    monkeypatch.setenv('PJRT_DEVICE', 'TPU')
    assert choose_dtype('auto', 'xla')[0] == 'bfloat16'
    monkeypatch.setenv('PJRT_DEVICE', 'CPU')  # XLA on the CPU: the CPU's rule
    assert choose_dtype('auto', 'xla', native_cpu_bf16=False)[0] == 'float32'


def one_step(toy, tmp_path):
    """train.py for one step of a tiny model with the default number format ('auto')."""
    return ['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--device=cpu', '--max_steps=1',
            '--hidden_size=32', '--num_heads=2', '--puzzle_emb_ndim=0', '--H_cycles=1', '--L_cycles=1',
            '--halt_max_steps=2', '--global_batch_size=10', '--xla_cache_dir=']


def test_train_says_which_format_it_chose_on_this_cpu(toy, tmp_path):
    from device import cpu_has_native_bf16
    p = run(one_step(toy, tmp_path))
    first = next(l for l in p.stdout.splitlines() if l.startswith('device cpu'))
    want = 'bfloat16' if cpu_has_native_bf16() else 'float32'
    assert f'forward dtype auto: {want} (CPU with' in first, first


@pytest.mark.parametrize('name,value', [('ONEDNN_MAX_CPU_ISA', 'AVX2'), ('ATEN_CPU_CAPABILITY', 'avx2')])
def test_torch_held_to_avx2_chooses_float32_as_an_avx2_machine_does_and_says_why(toy, tmp_path, name, value):
    # on any machine: how a machine with native bf16 runs the suite as a newcomer's AVX2 machine does (README)
    p = run(one_step(toy, tmp_path), env={name: value})
    first = next(l for l in p.stdout.splitlines() if l.startswith('device cpu'))
    assert f'forward dtype auto: float32 (CPU without native bf16 under {name}={value})' in first, first
    # bfloat16 typed is obeyed: the device line says so in its place, the warning is a line of its own before it
    lines = run(one_step(toy, tmp_path / 'bf16') + ['--forward_dtype=bfloat16'], env={name: value}).stdout.splitlines()
    at = next(i for i, l in enumerate(lines) if l.startswith('device cpu'))
    assert '| forward dtype bfloat16 (as configured, emulated: see the warning above) |' in lines[at], lines[at]
    assert [l for l in lines if 'warning' in l and 'bf16' in l] == [
        f'warning: forward_dtype=bfloat16 on a CPU without native bf16 under {name}={value}: it is emulated and runs '
        'many times slower than float32 (--forward_dtype=auto picks float32 here)'] == lines[at - 1:at], lines
