"""
Publish a checkpoint of train.py in the reference implementation's layout, the one its community checkpoints are
shared in (docs/published.md), and optionally commit it to a Hugging Face hub repository:
    python publish.py --init_from=out/quickstart/ckpt_00000703.pt              # -> out/quickstart/published/
    python publish.py --init_from=CKPT --out_dir=pub/run1 --train_state=True   # + step_<N>_train_state.pt
    HF_TOKEN=hf_... python publish.py --init_from=CKPT --repo=OWNER/trm-sudoku --path_in_repo=sudoku_mlp
It writes step_<N> (the EMA's weights under the reference's names, as the reference saves them), all_config.yaml
(the run's config as the reference's PretrainConfig fields: the model in `arch`, the data in data_paths) and,
asked, step_<N>_train_state.pt (raw weights and optimizer moments). The reference's own code loads step_<N>
(pretrain.py's load_checkpoint); train.py and solve.py load it with --init_from=PATH/step_<N>, or from the hub
with --init_from=hf://OWNER/REPO/PATH/step_<N>, and take the model keys from all_config.yaml. HF_ENDPOINT names
another hub server; HF_TOKEN (or `hf auth login`) the identity that may write the repository. A folder that holds
another run's step files (one all_config.yaml answers for all of them), or one another publish is writing into, is
refused, and a write that fails leaves the folder as it was (published.export).
"""
import os
import signal
import sys
import urllib.parse

# -----------------------------------------------------------------------------
# config
init_from = ''                  # the checkpoint of train.py to publish (out/RUN/ckpt_XXXXXXXX.pt)
out_dir = ''                    # folder to write the layout into ('': published/ beside the checkpoint)
weights = 'ema'                 # 'ema' (what the reference saves; the raw weights when there is no EMA) | 'model'
train_state = False             # also step_<N>_train_state.pt: raw weights and optimizer moments, for a resume
forward_dtype = ''              # the number format all_config.yaml names ('': the run's; its 'auto': bfloat16)
repo = ''                       # OWNER/REPO on the hub to commit the files to ('': write them only)
path_in_repo = ''               # the folder in the repository ('': the name of the checkpoint's run folder)
revision = 'main'               # the branch to commit to (it must exist)
private = True                  # a repository that does not exist yet is created private (False: public)
commit_message = ''             # ('': "<path_in_repo>: a TRM checkpoint")
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items()
               if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configurator.py')).read())
_one_of = lambda *a: (lambda v: v in a, ' | '.join(map(repr, a)))
RULES = dict(init_from=(lambda v: bool(v), 'a checkpoint of train.py, out/RUN/ckpt_XXXXXXXX.pt'),
             weights=_one_of('ema', 'model'), forward_dtype=_one_of('', 'bfloat16', 'float16', 'float32'),
             repo=(lambda v: v == '' or (v.count('/') == 1 and all(v.split('/'))), "'' or OWNER/REPO"),
             # written with local file calls: a gs:// or hf:// one would be a folder named 'gs:' here
             out_dir=(lambda v: v == '' or (bool(v.strip()) and '://' not in v),
                      "'' (published/ beside the checkpoint) or a local folder; for a bucket publish here, then "
                      "copy it, e.g. with gcloud storage cp; for the hub --repo=OWNER/REPO"))
bad = [f"{k}={globals()[k]!r} (allowed: {what})" for k, (ok, what) in RULES.items() if not ok(globals()[k])]
if bad:
    raise SystemExit("config error: " + '; '.join(bad))
if not os.path.isfile(init_from) and not os.path.isdir(init_from):
    raise SystemExit(f"init_from={init_from}: no such file (a checkpoint of train.py; a gs:// one: copy it here "
                     "first, e.g. with gcloud storage cp)")
# -----------------------------------------------------------------------------

from configurator import import_torch  # noqa: E402

import_torch()  # where an address-space limit leaves it no room: one line
from runkeep.startup import newest_in  # noqa: E402

if os.path.isdir(init_from):
    _newest = newest_in(init_from, reference=False)
    raise SystemExit(f"init_from={init_from} is a folder, not a checkpoint: " +
                     (f"name one in it, such as --init_from={_newest}" if _newest else
                      "it holds no ckpt_*.pt of train.py"))
from runkeep.checkpoint import CheckpointError, load_checkpoint, what_it_holds  # noqa: E402
from configurator import read_config_block  # noqa: E402
from runkeep.hub import address_problem, export, need_packages, upload  # noqa: E402

try:
    ckpt = load_checkpoint(init_from)
except CheckpointError as e:
    raise SystemExit(f"init_from: {e}")
missing = [k for k in ('model', 'config', 'step') + (('optimizer',) if train_state else ())
           if not isinstance(ckpt, dict) or k not in ckpt]
if missing:
    raise SystemExit(f"init_from={init_from} is not a checkpoint of train.py (no {', '.join(missing)}): it holds "
                     f"{what_it_holds(ckpt)}")
# a checkpoint of an earlier train.py may lack keys added since: they had today's defaults then
trainer = read_config_block(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'train.py'))
ckpt['config'] = {**{k: v for k, (v, _) in trainer.items()}, **ckpt['config']}
run_folder = os.path.dirname(os.path.abspath(init_from))
folder = out_dir or os.path.join(os.path.dirname(init_from), 'published')
where = (path_in_repo or os.path.basename(run_folder)).strip('/')
if repo:  # an address the hub cannot have, or a hub the environment forbids, is refused before anything is written
    need_packages('huggingface_hub', 'yaml', purpose=f"uploading to the hub repository {repo}")
    from huggingface_hub import constants
    offline = constants.is_offline_mode() and "HF_HUB_OFFLINE is set, and a commit needs the hub: unset it, or " \
        "publish without --repo"
    if problem := address_problem(repo, where, 'path_in_repo') or offline:
        raise SystemExit(f"config error: upload to {repo}: {problem}; nothing was written or committed")


def interrupted(what):
    """Ctrl-C: one line (a builder's words and exit code), not Python's traceback."""
    print(f"stopped by SIGINT: {what}", file=sys.stderr)
    raise SystemExit(128 + signal.SIGINT)


try:
    paths = export(ckpt, folder, weights, train_state, forward_dtype)
except KeyboardInterrupt:  # the files are staged first: the folder is as it was
    interrupted(f"nothing was published, and {folder} is as it was before")
which = 'EMA' if weights == 'ema' and ckpt.get('ema') else 'raw'
print(f"{init_from} (step {ckpt['step']}, the {which} weights) in the reference's layout:")
for p in paths:
    print(f"  {p} ({os.path.getsize(p) / 1e6:.1f} MB)")
print(f"load it with --init_from={paths[0]} (train.py, solve.py; the model keys come from all_config.yaml)")
if repo:
    try:
        commit = upload(paths, repo, where, revision, private, commit_message,
                        ckpt.get('run_id') or ckpt.get('wandb_run_id'))
    except KeyboardInterrupt:  # a hub commit goes in whole or not at all
        interrupted(f"the upload to {repo} was not finished; {folder} holds the files, and the same command "
                    "commits them")
    # without @REVISION an hf:// address reads main: another branch's file is named with it (a '/' in it encoded)
    branch = '' if revision == 'main' else '@' + urllib.parse.quote(revision, safe='')
    print(f"committed to {repo} (revision {revision}) as {commit}: load it with "
          f"--init_from=hf://{repo}{branch}/{where}/step_{ckpt['step']} (this exact commit: "
          f"hf://{repo}@{commit}/{where}/step_{ckpt['step']})")
