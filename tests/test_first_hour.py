"""
A pod's first hour with nothing silent: device='auto' on a machine with TPU chips and no PJRT_DEVICE stops
before any step; a hung rank is ended by the watchdog (stacks logged, non-zero exit, the rerun resumes) while
a slow but progressing run is not; --smoke=True ends with its verdict and leaves out_dir usable.
    python -m pytest -q tests/test_first_hour.py
"""
import json
import os

from conftest import TOY_ARGS, XLA_ENV, assert_user_error, make_reverse_dataset, run


def fake_pci(root, devices):
    """A sysfs PCI folder as the kernel lays it out: one folder per slot with its vendor and device ids."""
    for i, (vendor, device) in enumerate(devices):
        slot = os.path.join(root, f'0000:00:{i + 4:02x}.0')
        os.makedirs(slot)
        for name, value in (('vendor', vendor), ('device', device)):
            with open(os.path.join(slot, name), 'w') as f:
                f.write(value + '\n')
    return str(root)


def test_auto_on_a_tpu_vm_without_pjrt_device_stops_before_any_step(toy, tmp_path):
    tpu_vm = fake_pci(tmp_path / 'tpu', [('0x8086', '0x1237'), ('0x1ae0', '0x005e'), ('0x1ae0', '0x005e')])
    args = ['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o', *TOY_ARGS, '--max_steps=3']
    p = run(args + ['--device=auto'], env=dict(TRM_PCI_DEVICES=tpu_vm), check=False)
    assert_user_error(p, "device='auto' on a machine with 2 TPU chip(s) and no PJRT_DEVICE", 'PJRT_DEVICE=TPU',
                      '--device=cpu')
    assert 'step ' not in p.stdout and not os.path.exists(f'{tmp_path}/o')  # before any step or file
    # the host CPU stays possible when asked for
    p = run(args + ['--device=cpu'], env=dict(TRM_PCI_DEVICES=tpu_vm))
    assert 'device cpu x1' in p.stdout
    # a machine whose PCI bus holds no TPU (a Google device that is no TPU chip included): the CPU, as before
    no_tpu = fake_pci(tmp_path / 'cpu', [('0x8086', '0x1237'), ('0x1ae0', '0x0042')])
    p = run(args + ['--device=auto', f'--out_dir={tmp_path}/o2'], env=dict(TRM_PCI_DEVICES=no_tpu))
    assert 'device cpu x1' in p.stdout
