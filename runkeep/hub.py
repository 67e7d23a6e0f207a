"""
The reference implementation's published checkpoint layout, and the Hugging Face hub it is shared on.
    PATH/step_<N>              torch.save of the reference's model state dict ('_orig_mod.model.inner.*' keys)
    PATH/all_config.yaml       its training config (PretrainConfig): the model in `arch`, the data in data_paths
    PATH/step_<N>_train_state.pt   (written on request) optimizer moments and raw weights, for a later resume
Reading (train.py and solve.py, after the configurator): resolve_init_from() fetches an
hf://OWNER/REPO[@REVISION]/PATH/step_<N> into a local cache (resumable, once per commit) and takes the model keys
from the all_config.yaml beside the file, refusing a key the config files or the command line set to another
value, and the model keys that break train.py's rules (configurator.py); for train.py a checkpoint of its own
gives its run's model keys too, where none is set (one set to another value is used, and said). Writing
(publish.py): export() turns a checkpoint of train.py into the layout, all or nothing, and never over another
run's files (one all_config.yaml answers for every step_<N> beside it); upload() commits it to a hub repository.
The hub's own client (huggingface_hub) makes every request: HF_ENDPOINT picks the server, HF_TOKEN (or `hf auth
login`) the identity. The cache is TRM_HUB_CACHE (default ~/.cache/trm_hub).
Nothing here imports torch at import time: train.py resolves init_from before its config checks.
"""
import contextlib
import hashlib
import importlib
import math
import os
import posixpath
import re
import shutil
import signal
import sys
import time
import urllib.parse

from configurator import config_problems, fail

from .records import write_atomic

ARCH = 'recursive_reasoning.trm@TinyRecursiveReasoningModel_ACTV1'
LOSS = 'losses@ACTLossHead'
LOSS_TYPES = dict(stablemax='stablemax_cross_entropy', softmax='softmax_cross_entropy')
# the reference's config fields outside `arch` that are train.py's keys of the same name and meaning: how it learned
RECIPE_FIELDS = dict(global_batch_size=int, epochs=int, lr=float, lr_min_ratio=float, lr_warmup_steps=int,
                     weight_decay=float, beta1=float, beta2=float, puzzle_emb_lr=float, puzzle_emb_weight_decay=float,
                     seed=int, ema=bool, ema_rate=float)
# the reference's TRM config fields this trainer has, with their types; the defaults are the reference's, for
# the fields its all_config.yaml may leave out (None: it must hold them)
ARCH_FIELDS = dict(hidden_size=(int, None), num_heads=(int, None), expansion=(float, None), H_cycles=(int, None),
                   L_cycles=(int, None), L_layers=(int, None), halt_max_steps=(int, None),
                   halt_exploration_prob=(float, None), pos_encodings=(str, None), puzzle_emb_ndim=(int, 0),
                   puzzle_emb_len=(int, 16), mlp_t=(bool, False), forward_dtype=(str, 'bfloat16'),
                   no_ACT_continue=(bool, True), rms_norm_eps=(float, 1e-5), rope_theta=(float, 10000.0),
                   mlp_multiple=(int, 256))
# the fields of ARCH_FIELDS the reference fixes in its code (the last: its SwiGLU widths' rounding): written only
# where a run has another value, which this trainer reads back and the reference ignores
FIXED_FIELDS = ('rms_norm_eps', 'rope_theta', 'mlp_multiple')
# what a resume may change (train.py's RESUME_FIXED leaves them out) may also differ from the published run's:
# set explicitly, they win; every other model key set to another value than the run's is refused
MAY_DIFFER = ('halt_exploration_prob', 'forward_dtype', 'loss_dtype')
# the revision is the '@' right after the repository; the path may hold '@' too (a run folder's name, 'sudoku@h512')
HUB_RE = re.compile(r'hf://(?P<repo>[^/@]+/[^/@]+)(?:@(?P<rev>[^/]+))?/(?P<path>.+)$')
# a file fetch() cached (TRM_HUB_CACHE/OWNER--REPO/COMMIT/PATH, on whichever machine it ran)
CACHED_RE = re.compile(r'(?:^|/)(?P<owner>[^/]+?)--(?P<name>[^/]+)/(?P<commit>[0-9a-f]{40})/(?P<path>.+)$')
COMMIT_RE = re.compile(r'[0-9a-f]{40}')
# folders of a repository that the hub keeps for itself: no file of a commit may be in one (huggingface_hub's rule)
HUB_KEPT = ('.git', '.cache')
PUBLISH_LOCK = '.publishing.lock'  # export's: one publish into a folder at a time


def need_packages(*modules, purpose):
    """One line where a package of requirements.txt that `purpose` imports is missing (a machine that installed
    only torch and its own few, as a TPU VM's bare pip line does) rather than an import's traceback."""
    pip_names = dict(yaml='PyYAML')
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            fail(f"{purpose} needs the {pip_names.get(module, module)} package, which does not import here ({e}): "
                 "pip install -r requirements.txt")


# -----------------------------------------------------------------------------
# all_config.yaml <-> train.py's keys

def all_config_beside(path):
    """The all_config.yaml in the folder of `path`, or None."""
    found = os.path.join(os.path.dirname(os.path.abspath(path)), 'all_config.yaml')
    return found if os.path.isfile(found) else None


def read_all_config(path):
    """all_config.yaml as a dict; a file that is not YAML of a mapping is one line naming it."""
    need_packages('yaml', purpose=f"reading {path}")
    import yaml
    try:
        with open(path) as f:
            cfg = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:  # bytes that are no text: a damaged copy
        fail(f"{path} cannot be read as the reference's all_config.yaml: {e}")
    if not isinstance(cfg, dict) or not isinstance(cfg.get('arch'), dict):
        fail(f"{path} is not the reference's all_config.yaml: it has no `arch:` block (the model's config)")
    return cfg


def typed(value, kind, field, where):
    """value as `kind`, the way the reference's pydantic config accepts it (4 for 4.0, 4.0 for 4), or a
    one-line refusal naming the field ('arch.L_cycles') (an unresolved interpolation such as '${.hidden_size}'
    is not a number)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is bool and isinstance(value, bool) or kind is str and isinstance(value, str):
        return value
    if kind is float and number or kind is int and number and float(value).is_integer():
        return kind(value)
    fail(f"{where}: {field}={value!r} is not {'an' if kind is int else 'a'} {kind.__name__}")


def model_keys(cfg, where):
    """The model keys of train.py that an all_config.yaml (as a dict) sets: {key: value}. Another architecture,
    a loss or a number format this trainer does not have, or a layout the reference cannot run: one line."""
    arch = cfg['arch']
    if arch.get('name') != ARCH:
        fail(f"{where}: arch.name is {arch.get('name')!r}; this trainer loads the reference's TRM ({ARCH}) only")
    keys = {}
    for field, (kind, default) in ARCH_FIELDS.items():
        if field not in arch and default is None:
            fail(f"{where}: arch.{field} is missing (the reference's TRM config requires it)")
        keys[field] = typed(arch.get(field, default), kind, f"arch.{field}", where)
    loss = arch.get('loss') if isinstance(arch.get('loss'), dict) else {}
    types = {v: k for k, v in LOSS_TYPES.items()}
    if loss.get('name') != LOSS or loss.get('loss_type') not in types:
        fail(f"{where}: arch.loss is {loss!r}; this trainer has {LOSS} with loss_type "
             f"{' or '.join(types)}")
    keys['loss_type'] = types[loss['loss_type']]
    if keys['forward_dtype'] not in ('bfloat16', 'float16', 'float32'):
        fail(f"{where}: arch.forward_dtype={keys['forward_dtype']!r}; this trainer runs bfloat16, float16 or "
             "float32")
    if keys['pos_encodings'] not in ('rope', 'learned'):
        keys['pos_encodings'] = 'none'  # the reference adds no positions for any other value
    ndim, length = keys['puzzle_emb_ndim'], keys.pop('puzzle_emb_len')
    if ndim == 0 and length:
        fail(f"{where}: arch.puzzle_emb_ndim is 0 with puzzle_emb_len {length}: the reference reserves {length} "
             "positions that nothing fills, and its forward cannot add its inputs to them; not loadable")
    if ndim and keys['hidden_size'] > 0:  # the reference's 0: as many prefix positions as the embedding needs
        keys['puzzle_emb_len'] = length or math.ceil(ndim / keys['hidden_size'])
    if bad := config_problems(keys):  # train.py's rules, as for the same keys on a command line
        fail(f"{where}: " + '; '.join(f"arch.{b}" for b in bad))
    return keys


def published_run(path):
    """train.py's keys of the run whose state dict `path` is, from the all_config.yaml beside it: its model
    (model_keys), its recipe (RECIPE_FIELDS it holds) and data_path (the first of data_paths); None without an
    all_config.yaml. A field that breaks train.py's rules is one line naming the file."""
    where = all_config_beside(path)
    if where is None:
        return None
    cfg = read_all_config(where)
    recipe = {k: typed(cfg[k], kind, k, where) for k, kind in RECIPE_FIELDS.items() if k in cfg}
    if bad := config_problems(recipe):
        fail(f"{where}: " + '; '.join(bad))
    data_paths = cfg.get('data_paths') if isinstance(cfg.get('data_paths'), list) else []
    return {**model_keys(cfg, where), **recipe, **({'data_path': str(data_paths[0])} if data_paths else {})}


def same(a, b):
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    return float(a) == float(b) if number(a) and number(b) else a == b


def run_keys(g, set_by, keys):
    """A run's model keys ({key: value}) against a script's config globals `g`: (those keys, in g's types; the
    updates: the ones that no config file or flag set (`set_by`), the run's values; {key: the run's value} of
    the ones set to another value)."""
    keys = {k: type(g[k])(v) if isinstance(g[k], float) else v for k, v in keys.items() if k in g}
    differ = {k: v for k, v in keys.items() if k in set_by and not same(g[k], v)}
    return keys, {k: v for k, v in keys.items() if k not in set_by}, differ


def said_keys(g, set_by, keys, differ, whose):
    """The start-up line's words on a run's model keys: those taken, then each one set to another value."""
    return (', '.join(f"{k}={v!r}" for k, v in keys.items() if k not in differ)
            + ''.join(f"; {k}={g[k]!r} as set ({set_by[k]}), {whose} {v!r}" for k, v in differ.items()))


def hub_file(address):
    """(OWNER/REPO, PATH) of an hf:// address or of a file fetch() cached, whatever its revision; else None."""
    if m := HUB_RE.match(address):
        return m['repo'], m['path'].strip('/')
    if m := CACHED_RE.search(address):
        return f"{m['owner']}/{m['name']}", m['path']
    return None


def train_run(path):
    """weights_in's dict of a checkpoint of train.py at `path` (its run's config, its step), or None: a state
    dict, or a file that does not load (loading its weights says why). Memory-mapped: the tensors are not read."""
    from configurator import import_torch
    import_torch()  # where an address-space limit leaves it no room: one line
    from .checkpoint import CheckpointError, load_checkpoint, weights_in
    try:
        found = weights_in(load_checkpoint(path, mmap=True))
    except CheckpointError:
        return None
    return found if found and found['config'] else None


def resolve_init_from(g, ours=False):
    """A script's config globals `g` after the configurator (train.py's, solve.py's): the updates that make
    init_from a local file and its model keys those of the published run, {key: value}. init_from=hf://...:
    fetched into the cache. With an all_config.yaml beside a state dict (not beside a checkpoint of train.py,
    which has its own config): its model keys, checked against the keys the config files and the command line
    set (`_set_by`), refused in one line where one contradicts it; a data_path nobody set becomes its first
    data_paths where that is here (or where the script's default is '', solve.py's "the checkpoint's"). Says where
    the config came from in one line. Otherwise: nothing changes (the keys are the script's, as for any file), but
    with `ours` (train.py) a checkpoint of train.py to start from (not a resume's) gives its run's model keys where
    no config file or flag set them; one set to another value is used (changing no weight's shape, H_cycles at test
    time, say), and said in that line. train.py's resume:hf://... with checkpoints in out_dir of a run that started
    from that file fetches nothing: their run's model keys, data_path and the file it started from."""
    init_from, set_by, updates = g.get('init_from', ''), dict(g.get('_set_by') or {}), {}
    resume = 'resume:' if init_from.startswith('resume:') else ''  # resume, else start from the file after it
    init_from = init_from[len(resume):]
    if g.get('forward_dtype') == 'checkpoint':  # solve.py's word for "the run's", typed or not
        set_by.pop('forward_dtype', None)
    shown = init_from
    if resume and ours and HUB_RE.match(init_from or ''):
        # a run with checkpoints of its own resumes them without the file it started from (init_from_problems'
        # rule for resume:FILE): the hub need not be in reach, nor the file cached, and their model keys are the
        # run's (a resume checks them against its checkpoint), where that run started from this file
        from .startup import newest_in
        newest = newest_in(g.get('out_dir') or '', reference=False)
        found = newest and train_run(newest)
        started = str(found['config'].get('init_from') or '').removeprefix('resume:') if found else ''
        if found and hub_file(started) == hub_file(init_from):
            from model import MODEL_KEYS
            keys, taken, differ = run_keys(g, set_by, {k: v for k, v in found['config'].items() if k in MODEL_KEYS})
            data = found['config'].get('data_path') if 'data_path' not in set_by else None  # as all_config's was
            print(f"init_from=resume:{shown}: {g['out_dir']} holds the run's checkpoints (the newest: step "
                  f"{found['step']}), resumed without the published file; model config from its run: "
                  + said_keys(g, set_by, keys, differ, "the checkpoint's")
                  + (f"; data_path={data!r}, the run's" if data else ''))
            # the file it started from stays the run's record (publish.py's load_checkpoint: its commit)
            return {**taken, **({'data_path': data} if data else {}), 'init_from': resume + started}
    if HUB_RE.match(init_from or ''):
        init_from = fetch(init_from)
        updates['init_from'] = resume + init_from
    elif init_from.startswith('hf://'):
        fail(f"init_from={init_from}: a hub checkpoint is hf://OWNER/REPO/PATH/step_<N> (a revision: "
             "hf://OWNER/REPO@REVISION/PATH/step_<N>)")
    yaml_path = all_config_beside(init_from) if init_from and os.path.isfile(init_from) else None
    # a checkpoint of train.py carries its run's config: an all_config.yaml beside it (publish.py --out_dir=its
    # run folder) answers for the step files there, not for it
    found = init_from and os.path.isfile(init_from) and (yaml_path or ours and not resume) and train_run(init_from)
    if found:
        yaml_path = None
    if yaml_path is None:
        if found and ours and not resume:
            from model import MODEL_KEYS
            keys, taken, differ = run_keys(g, set_by, {k: v for k, v in found['config'].items() if k in MODEL_KEYS})
            print(f"init_from={shown}: a checkpoint of train.py (step {found['step']}); model config from its run: "
                  + said_keys(g, set_by, keys, differ, "the checkpoint's"))
            return {**updates, **taken}
        if shown != init_from and not found:
            print(f"init_from={shown}: {init_from}; no all_config.yaml beside it in the repository: the model "
                  "keys are this run's config, as for any state dict")
        return updates
    cfg = read_all_config(yaml_path)
    where = posixpath.join(posixpath.dirname(shown), 'all_config.yaml') if shown != init_from else yaml_path
    keys, taken, differ = run_keys(g, set_by, model_keys(cfg, where))
    clash = [f"{k}={g[k]!r} ({set_by[k]}) but the published run has {k}={v!r}" for k, v in differ.items()
             if k not in MAY_DIFFER]
    if clash:
        fail(f"config error: init_from={shown}: {'; '.join(clash)} ({where}). The weights were trained with "
             "the run's values: drop the key (it is taken from there), or start from scratch to change it")
    updates.update(taken)
    data_paths = cfg.get('data_paths') if isinstance(cfg.get('data_paths'), list) else []
    # a data_path nobody set is the run's where it is here (train.py's default names Sudoku's, which an ARC or
    # Maze checkpoint would be evaluated on), or where the script's own default is '' (solve.py: "the run's")
    taken_data = data_paths and 'data_path' not in set_by and (g.get('data_path') == '' or
                                                              os.path.isdir(str(data_paths[0])))
    if taken_data:
        updates['data_path'] = str(data_paths[0])
    cached = f", cached at {init_from}" if shown != init_from else ''
    print(f"init_from={shown}: a checkpoint in the reference's published layout{cached}; model config from "
          f"{where}: " + said_keys(g, set_by, keys, differ, "the run's") + f"; trained on data_paths={data_paths}"
          + (", data_path taken from there" if taken_data else ''))
    if note := other_length(data_paths, updates.get('data_path', g.get('data_path'))):
        print(f"note: init_from={shown}: {note}")
    return updates


def other_length(data_paths, data_path):
    """Where the published run's dataset (its first data_paths) and this run's are both here and hold puzzles of
    other lengths: the words naming both (weights that fit any length, attention with RoPE or no positions, meet
    one they never learned; MLP-t's and learned positions' are refused when they load); else ''."""
    from data import load_metadata
    try:
        was, now = (int(load_metadata(str(p), 'train')['seq_len']) for p in (data_paths[0], data_path))
    except (IndexError, OSError, ValueError, TypeError, KeyError):  # not here (another machine's, gs://): unknown
        return ''
    return '' if was == now else (f"the published run trained on seq_len {was} ({data_paths[0]}); {data_path} "
                                  f"holds seq_len {now}: its weights meet a length they never learned")


# -----------------------------------------------------------------------------
# the hub: hf://OWNER/REPO[@REVISION]/PATH, fetched once per commit into the cache, resumable

def hub_cache():
    return os.path.expanduser(os.environ.get('TRM_HUB_CACHE') or '~/.cache/trm_hub')


def fetch(uri):
    """The local copy of the file at an hf:// URI, and beside it the all_config.yaml of the same commit when
    the repository has one. A file already in the cache for the revision's commit is not downloaded again;
    an interrupted download resumes where it stopped (this process's retries, or a later run)."""
    need_packages('huggingface_hub', 'yaml', purpose=uri)
    m = HUB_RE.match(uri)
    repo, revision, path = m['repo'], urllib.parse.unquote(m['rev'] or 'main'), m['path'].strip('/')
    if problem := address_problem(repo, path):
        fail(f"init_from={uri}: {problem}")
    local, commit = fetch_file(repo, revision, path, uri)
    fetch_file(repo, commit, posixpath.join(posixpath.dirname(path), 'all_config.yaml'), uri, optional=True)
    return local


def address_problem(repo, path, flag=''):
    """Why OWNER/REPO and PATH cannot name a file of a hub repository, in words, or '': a repository id against the
    hub's naming rules (the client raises its traceback), a path with a '..' part (the HTTP client resolves it
    into another request, and the cache path would leave the repository's folder), or one in a folder the hub
    keeps for itself (HUB_KEPT: the client refuses to commit there, with its traceback). flag: the option that
    gave the path ('path_in_repo'), named in the words."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id
    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        return f"{repo!r} is not a repository id of the hub ({short(e)})"
    shown = f"{flag}={path!r}" if flag else f"the path {path!r}"
    allowed = "name it from the repository's root, with no '..', " + ' or '.join(map(repr, HUB_KEPT)) + " part"
    if bad := next((p for p in path.split('/') if p == '..' or p in HUB_KEPT), None):
        return f"{shown} has a {bad!r} part: {allowed}"
    return ''


def fetch_file(repo, revision, path, uri, optional=False):
    """(local path, commit) of one file of a hub repository; (None, None) for an optional file the
    repository does not have. Every refusal of the hub, and a hub out of reach with nothing cached, is one
    line; out of reach with a copy cached for the revision, that copy (said)."""
    import httpx2
    from huggingface_hub import constants, get_hf_file_metadata, get_token, hf_hub_url
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled,
                                        RemoteEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)
    folder = os.path.join(hub_cache(), repo.replace('/', '--'))
    ref = os.path.join(folder, 'refs', urllib.parse.quote(revision, safe=''))
    cached = lambda commit: os.path.join(folder, commit, *path.split('/'))
    # the hub's word that a commit has no such file: a hub out of reach later cannot tell it from a file never fetched
    absent = cached(revision) + '.absent'
    if COMMIT_RE.fullmatch(revision) and os.path.isfile(cached(revision)):
        if not corrupt(cached(revision)):
            return cached(revision), revision  # else the hub is asked for it, which says so
    if optional and os.path.isfile(absent):
        return None, None
    endpoint, url = constants.ENDPOINT, hf_hub_url(repo, path, revision=revision)
    try:
        if constants.is_offline_mode():
            raise OfflineModeIsEnabled('HF_HUB_OFFLINE is set')
        meta = get_hf_file_metadata(url)
    except RemoteEntryNotFoundError:
        if optional:
            if COMMIT_RE.fullmatch(revision):
                os.makedirs(os.path.dirname(absent), exist_ok=True)
                open(absent, 'w').close()
            return None, None
        fail(f"init_from={uri}: {repo} has no file {path} at revision {revision} ({endpoint})")
    except RevisionNotFoundError:
        fail(f"init_from={uri}: {repo} has no revision {revision!r} ({endpoint})")
    except GatedRepoError:
        fail(f"init_from={uri}: {repo} is gated: accept its terms on the hub, then set HF_TOKEN to a token of "
             "that account")
    except RepositoryNotFoundError:
        fail(f"init_from={uri}: no repository {repo} at {endpoint}, or a private one this identity may not "
             f"read ({'the token in use may not' if get_token() else 'set HF_TOKEN to a token that may'})")
    except (httpx2.TransportError, OfflineModeIsEnabled, HfHubHTTPError) as e:
        status = getattr(getattr(e, 'response', None), 'status_code', None)
        if isinstance(e, HfHubHTTPError) and status and status < 500:
            fail(f"init_from={uri}: the hub answered HTTP {status} for {path} ({short(e)})")
        commit = open(ref).read().strip() if os.path.isfile(ref) else revision
        # offline by choice asks nothing of the hub: the network is not what to check then
        offline = isinstance(e, OfflineModeIsEnabled)
        why = 'HF_HUB_OFFLINE is set' if offline else f"cannot reach {endpoint} ({short(e)})"
        then = 'unset HF_HUB_OFFLINE to download it' if offline else \
            'check the network (or HF_ENDPOINT), then rerun'
        if optional:  # all_config.yaml, whose model keys the weights need: not to be taken for none
            fail(f"init_from={uri}: {path} (the model config beside it) is not cached in {folder}, and "
                 + (f"HF_HUB_OFFLINE is set: {then}" if offline else
                    f"{endpoint} did not answer for it ({short(e)}): rerun once it does"))
        if os.path.isfile(cached(commit)):
            if bad := corrupt(cached(commit)):
                fail(f"init_from={uri}: {bad}, and {why}: "
                     + ('unset HF_HUB_OFFLINE to fetch it again' if offline else 'rerun once the hub answers'))
            print(f"warning: {why}: using the copy of {path} cached from commit {commit[:12]} of {revision!r}")
            return cached(commit), commit
        fail(f"init_from={uri}: {why} and {path} is not cached in {folder}: {then}")
    if not meta.commit_hash:
        fail(f"init_from={uri}: {endpoint} does not answer as a Hugging Face hub (no X-Repo-Commit header for "
             f"{url}): check HF_ENDPOINT")
    if revision != meta.commit_hash:
        os.makedirs(os.path.dirname(ref), exist_ok=True)
        # through a rename: written in place, a run killed midway left it empty, and the runs out of reach after it
        # found nothing cached. Its failure is another process of this host writing the same commit at once (one
        # .tmp between them), or a cache shared read-only
        with contextlib.suppress(OSError):
            write_atomic(ref, lambda f: f.write(meta.commit_hash))
    dest = cached(meta.commit_hash)
    if not (os.path.isfile(dest) and meta.size in (None, os.path.getsize(dest))):
        download(meta, url, dest, f"hf://{repo}@{meta.commit_hash[:12]}/{path}", uri)
    elif bad := corrupt(dest, announced(meta)):
        print(f"warning: {bad}: fetching it again", flush=True)
        download(meta, url, dest, f"hf://{repo}@{meta.commit_hash[:12]}/{path}", uri)
    return dest, meta.commit_hash


def announced(meta):
    """The sha256 the hub announces for a file it keeps in LFS (its ETag), or None (a file in git: a sha1)."""
    return meta.etag if meta.etag and re.fullmatch(r'[0-9a-f]{64}', meta.etag) else None


def sha256(path):
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def corrupt(path, expected=None):
    """Why the cached file at `path` is not the file it was downloaded as, in words, or None: its sha256 against
    `expected` (the hub's word), else against the one recorded beside it when it was downloaded (none recorded:
    nothing to tell; a record cut or garbled is none). A file that matches gets the record, so that a later run
    offline can tell too."""
    record, recorded = path + '.sha256', None
    if os.path.isfile(record):
        with open(record, 'rb') as f:
            recorded = f.read().strip().decode('ascii', 'replace')
        recorded = recorded if re.fullmatch(r'[0-9a-f]{64}', recorded) else None
    whose = 'the hub announces' if expected else 'recorded when it was downloaded'
    expected = expected or recorded
    if expected is None:
        return None
    if (got := sha256(path)) != expected:
        return f"the cached copy {path} has sha256 {got[:12]}..., not the {expected[:12]}... {whose}: it is corrupt"
    if recorded != got:
        with contextlib.suppress(OSError):  # a cache shared read-only: nothing to record
            write_atomic(record, lambda f: f.write(got))
    return None


def short(e, limit=160):
    text = ' '.join(str(e).split())
    return text if len(text) <= limit else text[:limit] + '...'


class LineProgress:
    """A download's progress as a line at every tenth of the file or every 30 s: a log file or a pipe gets no
    terminal bar. (The parts of tqdm that the hub client's download calls.)"""

    def __init__(self, total=None, initial=0, desc='', **_):
        self.total, self.done, self.desc, self.last = total, initial, desc, (time.time(), initial)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n):
        self.done += n
        t, d = self.last
        if self.total and (self.done - d >= self.total / 10 or time.time() - t >= 30 or self.done == self.total):
            print(f"  {self.desc}: {self.done / 1e6:.1f} of {self.total / 1e6:.1f} MB "
                  f"({100 * self.done / self.total:.0f}%)", flush=True)
            self.last = (time.time(), self.done)


def download(meta, url, dest, name, uri):
    """The file into dest through dest.incomplete, which a later run resumes from (one process at a time: a
    lock beside it); its bytes counted against the size the hub announced, and checked against the sha256 it
    announces for an LFS file. Its sha256 is recorded beside it (dest.sha256): a run that asks the hub nothing
    (a pinned commit, offline) checks the copy against it."""
    import httpx2
    from filelock import FileLock
    from huggingface_hub import constants, utils as hf_utils
    from huggingface_hub.file_download import http_get
    from huggingface_hub.errors import HfHubHTTPError
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    part = dest + '.incomplete'
    with FileLock(dest + '.lock'):
        whole = os.path.isfile(dest) and meta.size in (None, os.path.getsize(dest))
        if whole and not corrupt(dest, announced(meta)):
            return  # another process of this run fetched it meanwhile
        have = os.path.getsize(part) if os.path.isfile(part) else 0
        have = have if meta.size is None or have <= meta.size else 0
        free = shutil.disk_usage(os.path.dirname(dest)).free
        if meta.size and meta.size - have > free:
            fail(f"init_from={uri}: {name} needs {(meta.size - have) / 1e6:.1f} MB more; "
                 f"{os.path.dirname(dest)} has {free / 1e6:.1f} MB free (TRM_HUB_CACHE picks another place)")
        size = f"{meta.size / 1e6:.1f} MB" if meta.size is not None else 'size not announced'
        print(f"downloading {name} ({size}) into {dest}"
              + (f", resuming after the {have / 1e6:.1f} MB fetched before" if have else ''), flush=True)
        headers = hf_utils.build_hf_headers()  # HF_TOKEN, or the token `hf auth login` saved
        origin = lambda u: urllib.parse.urlsplit(u)[:2]
        if origin(meta.location) != origin(url):  # a storage host's signed URL: the token stays on the hub
            headers.pop('authorization', None)
        # what arrives reaches the file at once (unbuffered, in chunks of 1 MB instead of the client's 10 MB): a
        # killed run loses little of what it fetched
        constants.DOWNLOAD_CHUNK_SIZE = min(constants.DOWNLOAD_CHUNK_SIZE, 1 << 20)
        try:
            with open(part, 'r+b' if have else 'wb', buffering=0) as f:
                f.seek(have)
                f.truncate()
                http_get(meta.location, f, resume_size=have, headers=headers, expected_size=meta.size,
                         displayed_filename=name.rsplit('/', 1)[-1],
                         tqdm_class=None if sys.stderr.isatty() else LineProgress)
        except (httpx2.TransportError, HfHubHTTPError, OSError) as e:
            got = os.path.getsize(part) if os.path.isfile(part) else 0
            fail(f"init_from={uri}: the download of {name} stopped at {got / 1e6:.1f} MB of {size} "
                 f"({short(e)}); rerun to resume it")
        except KeyboardInterrupt:  # Ctrl-C (a builder's words and exit code): what arrived is kept
            got = os.path.getsize(part) if os.path.isfile(part) else 0
            print(f"stopped by SIGINT: the download of {name} stopped at {got / 1e6:.1f} MB of {size}; the same "
                  "command resumes it", file=sys.stderr)
            raise SystemExit(128 + signal.SIGINT)
        got = sha256(part)
        if announced(meta) not in (None, got):
            os.remove(part)
            words = f"has sha256 {got[:12]}..., not the {announced(meta)[:12]}... the hub announces"
            if not have:
                fail(f"init_from={uri}: the download of {name} {words}; removed: rerun to fetch it again")
            # the bytes kept from before were damaged on disk: once more, from the start
            print(f"warning: the download of {name}, resumed after {have / 1e6:.1f} MB, {words}: fetching it "
                  "again from the start", flush=True)
        else:
            write_atomic(dest + '.sha256', lambda f: f.write(got))
            os.replace(part, dest)
            return
    download(meta, url, dest, name, uri)


# -----------------------------------------------------------------------------
# writing the layout from a checkpoint of train.py, and committing it to a hub repository

def reference_weights(sd, cfg, forward_dtype):
    """A state dict of this model as the reference's compiled, loss-wrapped model saves it: its names, no
    puzzle table when puzzle_emb_ndim is 0 (the reference has none), the latents' init buffers in the forward dtype
    (the reference keeps them so; this model casts them to it at use, so nothing changes)."""
    import torch
    from model import INIT_BUFFERS, to_reference_state_dict
    sd = {k: v for k, v in sd.items() if not (k == 'puzzle_emb' and cfg['puzzle_emb_ndim'] == 0)}
    for k in INIT_BUFFERS.values():
        sd[k] = sd[k].to(getattr(torch, forward_dtype))
    return to_reference_state_dict(sd)


def all_config(cfg, folder, forward_dtype, arc, run_id=None):
    """The reference's all_config.yaml (PretrainConfig's fields) of a run of train.py (its config dict, and the
    run id its checkpoints carry: run_name ends in it, as the reference's ends in a random slug)."""
    ndim = cfg['puzzle_emb_ndim']
    arch = dict(name=ARCH, loss=dict(name=LOSS, loss_type=LOSS_TYPES[cfg['loss_type']]), H_layers=0,
                **{k: cfg[k] for k in ARCH_FIELDS if k not in FIXED_FIELDS})
    arch.update(forward_dtype=forward_dtype, expansion=float(cfg['expansion']),
                puzzle_emb_len=cfg['puzzle_emb_len'] if ndim else 0)  # 0 and 0: no prefix, as this model
    for k in FIXED_FIELDS:
        if not same(cfg.get(k, ARCH_FIELDS[k][1]), ARCH_FIELDS[k][1]):  # (a checkpoint from before the key: 256)
            arch[k] = cfg[k]
    from .checkpoint import resume_parts
    started_from = resume_parts(cfg.get('init_from', 'scratch'))[1]  # 'resume:FILE' started from FILE
    if m := CACHED_RE.search(started_from or ''):  # shared with the weights: the hub's address, not a cache path
        started_from = f"hf://{m['owner']}/{m['name']}@{m['commit']}/{m['path']}"
    return dict(arch=arch, data_paths=[cfg['data_path']], data_paths_test=[],
                evaluators=[dict(name='arc@ARC')] if arc else [], checkpoint_path=folder,
                checkpoint_every_eval=True, eval_interval=eval_interval(cfg['epochs'], cfg['eval_every_epochs']),
                min_eval_interval=0,
                eval_save_outputs=[], freeze_weights=bool(cfg.get('freeze_weights', False)),
                load_checkpoint=started_from or None, project_name=cfg.get('wandb_project'),
                run_name=' '.join(filter(None, (cfg.get('wandb_run_name') or
                                                os.path.basename(os.path.normpath(cfg['out_dir'])), run_id))),
                **{k: cfg[k] for k in RECIPE_FIELDS})


def eval_interval(epochs, every):
    """all_config.yaml's eval_interval for a run of `epochs` that evaluated every `every` epochs: `every` where it
    divides epochs, else the divisor of epochs nearest to it, of two as near the smaller. The reference's
    pretrain.py asserts epochs % eval_interval == 0 (it trains eval_interval epochs per evaluation), where this
    trainer's last evaluation is at the end whatever is left: the nearest interval it accepts keeps the run's
    pace, and the smaller evaluates and checkpoints no less often than the run did."""
    if not (isinstance(epochs, int) and isinstance(every, int) and epochs > 0 and every > 0) or epochs % every == 0:
        return every
    divisors = {d for i in range(1, math.isqrt(epochs) + 1) if epochs % i == 0 for d in (i, epochs // i)}
    return min(divisors, key=lambda d: (abs(d - every), d))


def train_state(ckpt, cfg):
    """step_<N>_train_state.pt: what the reference's step_<N> lacks for a resume, in its names and its
    optimizers' order: `weights` (the raw weights; the puzzle table is step_<N>'s, which the EMA never
    averages), `optimizers` (torch.optim state dicts: the puzzle embedding's sign-SGD (no state) when there is
    a table, then AdamATan2's moments with `step` for this trainer's `t`), `optimizer_lrs`, `param_names`
    (AdamATan2's parameters in order) and `step`."""
    from model import INIT_BUFFERS, to_reference_state_dict
    raw = {k: v for k, v in ckpt['model'].items() if k != 'puzzle_emb'}
    names = [k for k in to_reference_state_dict(raw) if not k.endswith(tuple(INIT_BUFFERS.values()))]
    opt = ckpt['optimizer']
    renamed = lambda s: {('step' if k == 't' else k): v for k, v in s.items()}
    adam = dict(state={i: renamed(s) for i, s in opt['state'].items()},
                param_groups=[dict(g, lr=cfg['lr']) for g in opt['param_groups']])
    held = len(adam['param_groups'][0]['params'])
    if held != len(names):
        fail(f"the checkpoint's optimizer holds {held} parameters, its model {len(names)}: not a checkpoint of "
             "this trainer's model")
    sign_sgd = dict(state={}, param_groups=[dict(  # its parameters: the table's weights, local_weights, local_ids
        lr=cfg['puzzle_emb_lr'], weight_decay=cfg['puzzle_emb_weight_decay'], world_size=1, params=[0, 1, 2])])
    table = cfg['puzzle_emb_ndim'] > 0
    return dict(step=ckpt['step'], weights=to_reference_state_dict(raw), param_names=names,
                optimizers=([sign_sgd] if table else []) + [adam],
                optimizer_lrs=([cfg['puzzle_emb_lr']] if table else []) + [cfg['lr']])


# all_config.yaml answers for every step_<N> beside it: these fields of it are the run's (a resume may change none
# of them), so a checkpoint whose run has other values is another run's; the others (lr, epochs, ...) and the arch
# fields of MAY_DIFFER a resume may change, and all_config.yaml takes the newest checkpoint's, said. run_name is
# the run's where its run id differs (a renamed folder or another W&B name keeps the run's id)
RUN_FIELDS = ('data_paths', 'global_batch_size', 'seed')  # and every arch field but MAY_DIFFER's
RUN_ID_RE = re.compile(r'(?P<name>.*) (?P<id>[0-9a-z]{8})$')


def same_run(theirs, ours, run_id=None):
    """Whether the run_name `theirs` names the run of `ours` (all_config's, ending in `run_id`, the id its
    checkpoint carries, where there is one): by that id, whatever name is before it; a run_name written without
    one (an earlier publish.py's), by the name. The checkpoint's id, not the shape of the words: an earlier
    run_name may end in a word of 8 lowercase letters and digits too."""
    theirs = str(theirs)
    if run_id:
        return theirs.split(' ')[-1] == run_id or theirs == ours.removesuffix(' ' + run_id)
    m = RUN_ID_RE.fullmatch(theirs)  # a checkpoint of an earlier train.py, without an id
    return theirs == ours or bool(m) and m['name'] == ours


def run_changes(theirs, config, run_id=None):
    """The fields that all_config.yaml `theirs` (a dict) and `config` (of a checkpoint carrying `run_id`) give
    other values, as (field, theirs, ours), and those of them that no resume changes: where they differ, `config`
    is another run's."""
    differ = lambda a, b: [k for k in sorted(set(a) | set(b)) if not same(a.get(k), b.get(k))]
    arch = theirs.get('arch') if isinstance(theirs.get('arch'), dict) else {}
    changed = [(f"arch.{k}", arch.get(k), config['arch'].get(k)) for k in differ(arch, config['arch'])]
    changed += [(k, theirs.get(k), config.get(k)) for k in differ(theirs, config) if k != 'arch']
    fixed = [c for c in changed if c[0] in RUN_FIELDS or c[0].startswith('arch.') and c[0][5:] not in MAY_DIFFER
             or c[0] == 'run_name' and not same_run(c[1], c[2], run_id)]
    return changed, fixed


def clash_words(fixed):
    """run_changes' `fixed`, where a folder holds another run's steps, in the words both refusals use."""
    return ("whose all_config.yaml has " + ', '.join(f"{k}={a!r}" for k, a, _ in fixed) + " where this "
            "checkpoint's would have " + ', '.join(f"{k}={b!r}" for k, _, b in fixed) + "; it answers for every "
            "step_<N> beside it (they would load with the new values)")


def folder_problem(folder, config, weights, step, run_id=None):
    """Why `folder` cannot take step_<step> (the state dict `weights`) and the all_config.yaml `config` (a
    dict; of a checkpoint carrying `run_id`), in one line, or '': it holds step files of another run (RUN_FIELDS
    or its run id differ, or no all_config.yaml says whose they are), or a step_<step> of other weights. Fields a
    resume may change are replaced, said."""
    import torch
    import yaml
    steps = sorted((n for n in os.listdir(folder) if re.fullmatch(r'step_\d+', n)), key=lambda n: int(n[5:])) \
        if os.path.isdir(folder) else []
    path = os.path.join(folder, 'all_config.yaml')
    then = "publish into another folder (--out_dir=...), or move those files aside first"
    there = f"{', '.join(steps[:3])}{' ...' if len(steps) > 3 else ''}"
    theirs = None
    if os.path.isfile(path):
        try:
            with open(path) as f:
                theirs = yaml.safe_load(f)
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            return f"out_dir={folder}: its all_config.yaml cannot be read ({short(e)}): {then}"
    if steps and not isinstance(theirs, dict):
        return f"out_dir={folder} holds {there} with no all_config.yaml to say whose they are: {then}"
    if not isinstance(theirs, dict):
        return ''
    run = f"the run {theirs.get('run_name')!r} (data_paths {theirs.get('data_paths')})"
    changed, fixed = run_changes(theirs, config, run_id)
    if steps and fixed:
        return f"out_dir={folder} holds {there} of {run}, {clash_words(fixed)}: {then}"
    mine = os.path.join(folder, f'step_{step}')
    if os.path.isfile(mine):
        try:
            old = torch.load(mine, map_location='cpu', weights_only=True)
        except Exception as e:  # noqa: BLE001 (any file that is not a state dict)
            return f"out_dir={folder}: its step_{step} does not load ({short(e)}): {then}"
        if not (isinstance(old, dict) and old.keys() == weights.keys() and
                all(old[k].dtype == v.dtype and torch.equal(old[k], v) for k, v in weights.items())):
            return (f"out_dir={folder} holds a step_{step} of other weights (of {run}: another run, or other "
                    f"weights of this one, --weights): {then}")
    if changed:
        print(f"{path} replaced by this checkpoint's: " + ', '.join(f"{k} {a!r} -> {b!r}" for k, a, b in changed))
    return ''


def export(ckpt, folder, weights='ema', with_train_state=False, forward_dtype=''):
    """A loaded checkpoint of train.py written into `folder` in the reference's layout: step_<N> (the EMA's
    weights, as the reference saves them, or `weights='model'`: the raw ones), all_config.yaml and, asked,
    step_<N>_train_state.pt. forward_dtype: the one all_config.yaml names ('': the run's; its 'auto' is
    bfloat16, what it picks on a GPU or TPU). Returns the paths written. One publish at a time holds the folder
    (PUBLISH_LOCK in it; another is refused, naming it); a folder of another run's files is refused
    (folder_problem); every file is written into folder/.publishing first and renamed into place once all are
    whole, so a failed write (a full disk, a file-size limit) leaves the folder as it was, and no folder where
    there was none. Each refusal and failure is one line."""
    need_packages('yaml', purpose='a published folder (all_config.yaml)')
    import yaml
    from .checkpoint import CheckpointError, save_atomic
    from .locks import create_lock
    cfg, step = ckpt['config'], ckpt['step']
    dtype = forward_dtype or (cfg['forward_dtype'] if cfg['forward_dtype'] != 'auto' else 'bfloat16')
    chosen = ckpt['ema'] if weights == 'ema' and ckpt.get('ema') else ckpt['model']
    arc = (ckpt.get('data') or {}).get('puzzle_type') == 'arc'
    run_id = ckpt.get('run_id') or ckpt.get('wandb_run_id')
    sd, config = reference_weights(chosen, cfg, dtype), all_config(cfg, folder, dtype, arc, run_id)
    names = [f'step_{step}', 'all_config.yaml'] + ([f'step_{step}_train_state.pt'] if with_train_state else [])
    made, up = [], os.path.abspath(folder)
    while not os.path.lexists(up):  # the folders this publish makes, deepest first: gone again if it fails
        made.append(up)
        up = os.path.dirname(up)
    stage, lock, done = os.path.join(folder, '.publishing'), None, False
    try:
        os.makedirs(folder, exist_ok=True)
        # two publishes at once would share .publishing, and each checks the folder before the other's files
        # land there: the second is refused while the first holds the lock
        if problems := create_lock(folder, PUBLISH_LOCK, 'publish', 'out_dir', f"out_dir={folder}"):
            fail(problems[0])
        lock = os.path.join(folder, PUBLISH_LOCK)
        if problem := folder_problem(folder, config, sd, step, run_id):
            fail(problem)
        shutil.rmtree(stage, ignore_errors=True)  # what a publish killed midway had staged is no one's
        os.makedirs(stage, exist_ok=True)
        save_atomic(sd, os.path.join(stage, names[0]))
        with open(os.path.join(stage, names[1]), 'w') as f:
            yaml.safe_dump(config, f)  # sorted keys, as the reference's yaml.dump
        if with_train_state:
            save_atomic(train_state(ckpt, cfg), os.path.join(stage, names[2]))
        for n in names:
            os.replace(os.path.join(stage, n), os.path.join(folder, n))
        os.rmdir(stage)
        done = True
    except (CheckpointError, OSError) as e:
        if isinstance(e, (FileExistsError, NotADirectoryError)) and not os.path.isdir(folder):
            fail(f"out_dir={folder} is not a folder, and cannot be made one ({e.strerror}): give a folder")
        # a staged file is named where it was going; anything else (a folder above out_dir) as it is
        why = str(e) if isinstance(e, CheckpointError) else \
            f"could not write {e.filename or os.path.join(stage, names[1])}: {e.strerror or e}"
        why = why.replace(stage + os.sep, folder + os.sep)
        fail(f"publish: {why}; nothing was published, and {folder} is as it was before")
    finally:  # a refusal, a failure and Ctrl-C (the caller says it) alike
        if not done and lock:
            shutil.rmtree(stage, ignore_errors=True)
        if lock:
            with contextlib.suppress(OSError):
                os.remove(lock)
        if not done:
            for d in made:
                with contextlib.suppress(OSError):
                    os.rmdir(d)
    return [os.path.join(folder, n) for n in names]


def upload(paths, repo, path_in_repo, revision='main', private=True, message='', run_id=None):
    """The files committed to a hub repository (created, private unless said otherwise, when it does not exist)
    under path_in_repo; returns the commit's id. run_id: the checkpoint's, which says whether a path_in_repo
    that holds steps holds this run's (same_run). A refusal of the hub is one line."""
    need_packages('huggingface_hub', 'yaml', purpose=f"uploading to the hub repository {repo}")
    import tempfile
    import yaml
    from huggingface_hub import CommitOperationAdd, HfApi, constants
    from huggingface_hub.errors import (HfHubHTTPError, RemoteEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)
    import httpx2
    api = HfApi()  # HF_ENDPOINT's hub, the token of HF_TOKEN or `hf auth login`
    ops = [CommitOperationAdd(path_in_repo=posixpath.join(path_in_repo, os.path.basename(p)), path_or_fileobj=p)
           for p in paths]
    theirs_at = posixpath.join(path_in_repo, 'all_config.yaml')
    try:
        # one all_config.yaml answers for every step_<N> beside it on the hub too (folder_problem's rule)
        try:
            with tempfile.TemporaryDirectory() as tmp, open(api.hf_hub_download(
                    repo, theirs_at, revision=revision, cache_dir=tmp)) as f:
                theirs = yaml.safe_load(f)
        except RemoteEntryNotFoundError:
            theirs = None
        except (RepositoryNotFoundError, RevisionNotFoundError) as e:
            # a commit goes to a branch that exists, and a repository is created with main alone: a missing branch
            # is refused before create_repo leaves an empty repository behind
            if revision != 'main' or isinstance(e, RevisionNotFoundError):
                fail(f"upload to {repo}: no branch {revision!r} there ({constants.ENDPOINT}"
                     + ("; nor the repository, or a private one this identity may not read"
                        if not isinstance(e, RevisionNotFoundError) else '')
                     + "): create the branch on the hub first, or commit to main (--revision=main); nothing was "
                     "committed")
            theirs = None  # no repository yet: created below
        with open(next(p for p in paths if p.endswith('all_config.yaml'))) as f:
            fixed = run_changes(theirs, yaml.safe_load(f), run_id)[1] if isinstance(theirs, dict) else []
        if fixed:
            fail(f"upload to {repo}: its {path_in_repo}/ holds the steps of the run {theirs.get('run_name')!r}, "
                 f"{clash_words(fixed)}: give another --path_in_repo; nothing was committed")
        api.create_repo(repo, private=private, exist_ok=True)
        return api.create_commit(repo, ops, revision=revision,
                                 commit_message=message or f"{path_in_repo}: a TRM checkpoint").oid
    except HfHubHTTPError as e:
        status = getattr(e.response, 'status_code', '?')
        hint = ': set HF_TOKEN to a token with write access to it' if status in (401, 403) else ''
        fail(f"upload to {repo} at {constants.ENDPOINT}: the hub answered HTTP {status} ({short(e)}){hint}")
    except (httpx2.TransportError, OSError) as e:
        fail(f"upload to {repo}: cannot reach {constants.ENDPOINT} ({short(e)}); nothing was committed")


# -----------------------------------------------------------------------------
# files that are none of these
