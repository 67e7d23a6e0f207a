"""
docs/forking.md's "Changing the recursion", made as a forker makes it: its edits, read off the page, applied to
model.py alone in a copy of the repository; then the copy trains, saves and resumes a checkpoint that carries the
third latent, counts it in the memory check, and solves with it.
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import torch

from conftest import ROOT, SUDOKU, assert_user_error, script_env

# what a copy of the repository needs to run its scripts (its tests and docs stay behind)
LEFT_BEHIND = {'.git', '.venv', 'venv', 'docs', 'tests', 'out', 'data', 'wandb', '__pycache__', '.pytest_cache',
               '.gpu', 'sky'}


def recursion_edits():
    """The (old, new) pairs of code the section shows, in its order: 'replace ```old``` with ```new```'."""
    page = open(os.path.join(ROOT, 'docs', 'forking.md')).read()
    section = page.split('## Changing the recursion', 1)[1].split('\n## ', 1)[0]
    blocks = re.findall(r'```python\n(.*?)```', section, re.S)
    assert len(blocks) >= 2 and len(blocks) % 2 == 0, blocks
    return list(zip(blocks[::2], blocks[1::2]))


def forked_copy(tmp_path):
    repo = tmp_path / 'fork'
    shutil.copytree(ROOT, repo, ignore=lambda d, names: [n for n in names if n in LEFT_BEHIND])
    model = repo / 'model.py'
    code = model.read_text()
    for old, new in recursion_edits():
        assert code.count(old) == 1, f"docs/forking.md's edit does not match model.py once:\n{old}"
        code = code.replace(old, new)
    model.write_text(code)
    return repo


def in_copy(repo, *args, check=True):
    p = subprocess.run([sys.executable, *args], cwd=repo, env=script_env(), capture_output=True, text=True, timeout=600)
    assert not check or p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def test_a_third_latent_is_a_change_to_model_py_alone(tmp_path, sudoku4, trained):
    repo = forked_copy(tmp_path)
    out = tmp_path / 'out'
    train = ['train.py', f'--data_path={sudoku4}', f'--out_dir={out}'] + SUDOKU
    in_copy(repo, *train, '--max_steps=3', '--checkpoint_interval=3')
    ckpt = torch.load(out / 'ckpt_00000003.pt', weights_only=False)
    assert sorted(k for k in ckpt['carry'] if ckpt['carry'][k].dim() == 3) == ['w', 'y', 'z']
    assert 'W_init' in ckpt['model']

    # the round trip: resumed, it trains on from step 3 with the carry it saved
    p = in_copy(repo, *train, '--max_steps=5', '--checkpoint_interval=1', '--init_from=resume')
    assert 'ckpt_00000003.pt' in p.stdout and 'step 5/5' in p.stdout, p.stdout[-2000:]
    assert os.path.exists(out / 'ckpt_00000005.pt')

    # the memory check counts one more latent per row of the carry and of an evaluation
    count = ("import json, sys; from runkeep.memory import config_memory; cfg, data = json.loads(sys.argv[1]); "
             "print(json.dumps(config_memory(cfg, data, 'cpu')))")
    data = dict(seq_len=16, vocab_size=6, num_puzzle_identifiers=1)
    parts = {name: json.loads(subprocess.run([sys.executable, '-c', count, json.dumps([ckpt['config'], data])],
                                             cwd=where, capture_output=True, text=True, check=True).stdout)
             for name, where in (('fork', repo), ('paper', ROOT))}
    row = (16 + ckpt['config']['puzzle_emb_len'] * (ckpt['config']['puzzle_emb_ndim'] > 0)) * \
        ckpt['config']['hidden_size'] * 4  # one latent of one row, float32
    batch = ckpt['config']['global_batch_size']
    assert parts['fork']['carry'] - parts['paper']['carry'] == batch * row
    assert parts['fork']['evaluation'] - parts['paper']['evaluation'] == batch * row

    # solve.py runs the three-latent recursion step by step
    p = in_copy(repo, 'solve.py', f'--init_from={out / "ckpt_00000005.pt"}', f'--data_path={sudoku4}', '--index=0',
                '--all_steps=True')
    assert 'step 1' in p.stdout or 'step  1' in p.stdout, p.stdout[-2000:]

    # a checkpoint of the paper's two latents is not the fork's: refused in one line
    two = sorted(glob.glob(os.path.join(trained, 'ckpt_*.pt')))[-1]
    p = in_copy(repo, 'solve.py', f'--init_from={two}', f'--data_path={sudoku4}', '--index=0', check=False)
    assert_user_error(p, 'W_init')
    # nor resumed into it: one line naming the key and the code that differs, never the advice to move the file
    # aside (the run would then start from scratch), and the file kept
    paper = tmp_path / 'paper'
    shutil.copytree(trained, paper)
    p = in_copy(repo, *(['train.py', f'--data_path={sudoku4}', f'--out_dir={paper}'] + SUDOKU), '--max_steps=6',
                '--init_from=resume', check=False)
    said = assert_user_error(p, 'W_init', 'model.py')
    assert 'aside' not in said, said[-2000:]
    assert sorted(os.listdir(paper)) == sorted(os.listdir(trained))
