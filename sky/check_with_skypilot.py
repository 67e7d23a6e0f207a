"""
Loads every task file in this folder with SkyPilot's own parser, and with --write refreshes skypilot_schema.json,
the part of SkyPilot that tests/test_sky.py checks the files against. Run it where SkyPilot is installed, in a
virtual environment of its own (skypilot 0.14.1 pins click < 8.2, the trainer's wandb 0.31 needs click >= 8.2):
    python -m venv /tmp/sky-venv && /tmp/sky-venv/bin/pip install skypilot==0.14.1
    /tmp/sky-venv/bin/python sky/check_with_skypilot.py [--write]
It validates as SkyPilot's API server does (every request of `sky jobs launch` goes through one): strictly, with
unknown keys refused also inside job_recovery, where the client alone lets them through to the server.
No cloud is contacted. Raise the version in requirements-test.txt's comment and docs/spot.md with the file.
"""
import glob
import json
import os
import sys

os.environ['IS_SKYPILOT_SERVER'] = '1'  # SkyPilot's server-side validation (strict once its plugins are loaded)

import yaml  # noqa: E402

import sky  # noqa: E402
from sky import catalog  # noqa: E402
from sky.server import plugins  # noqa: E402
from sky.utils import registry, schemas  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEMA = os.path.join(HERE, 'skypilot_schema.json')


def main(write):
    plugins._plugins_loaded = True  # a server with no plugin: nothing may add job_recovery keys
    if write:
        data = dict(skypilot=sky.__version__,
                    made_by='python sky/check_with_skypilot.py --write, in a venv with skypilot==' + sky.__version__,
                    task_schema=schemas.get_task_schema(), resources_schema=schemas.get_resources_schema(),
                    recovery_strategies=sorted(registry.JOBS_RECOVERY_STRATEGY_REGISTRY),
                    tpus=catalog.get_tpus(), gpus=catalog.get_common_gpus())
        with open(SCHEMA, 'w') as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write('\n')
        print(f"wrote {SCHEMA} (SkyPilot {sky.__version__})")
    bad = 0
    for path in sorted(glob.glob(os.path.join(HERE, '*.yaml'))):
        with open(path) as f:
            config = yaml.safe_load(f)
        try:  # the required envs (null in the file) as `sky jobs launch --env` gives them
            task = sky.Task.from_yaml_config(config, env_overrides=[
                (k, 'x') for k, v in (config.get('envs') or {}).items() if v is None])
        except Exception as e:  # SkyPilot's ValueError, InvalidSkyPilotConfigError, ...
            print(f"{os.path.relpath(path)}: REFUSED: {e}")
            bad += 1
            continue
        for r in task.resources:
            print(f"{os.path.relpath(path)}: ok: {r} x{task.num_nodes}, job_recovery {r.job_recovery}")
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main('--write' in sys.argv[1:]))
