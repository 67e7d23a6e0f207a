"""
A real full disk for tests: a small tmpfs mounted on a folder (root only; a test skips where mounting is not
permitted), and filled up to its last bytes when asked.
"""
import contextlib
import os
import subprocess

import pytest


@contextlib.contextmanager
def small_disk(path, size='1m', fill=False):
    """A tmpfs of `size` on `path` (made if absent) for the block; fill=True leaves no byte free on it."""
    os.makedirs(path, exist_ok=True)
    p = subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', str(path)], capture_output=True,
                       text=True)
    if p.returncode != 0:
        pytest.skip(f"a small tmpfs cannot be mounted here ({p.stderr.strip()})")
    try:
        if fill:
            fill_up(path)
        yield path
    finally:
        subprocess.run(['umount', '-l', str(path)], capture_output=True)


def fill_up(path):
    """Write a filler file on `path`'s filesystem until a write fails: the disk is full."""
    f = open(os.path.join(path, '.filler'), 'wb', buffering=0)  # unbuffered: nothing left to fail at close
    try:
        while f.write(b'\0' * 4096):
            pass
    except OSError:
        pass
    finally:
        f.close()
