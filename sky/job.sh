# What a SkyPilot managed job needs around the trainer's own commands, sourced by the task files beside this one
# (`source sky/job.sh` in their setup and run, which SkyPilot runs with bash in its copy of this repository on
# every node). The trainer knows nothing of SkyPilot: these functions only read SkyPilot's variables, the
# task's envs and the bucket (with the trainer's own client, gcs.py). docs/spot.md says why each one is there.
#   RUN            the run's name: --env RUN=NAME, else the managed job's task id, the same in every recovery
#   dataset_once   setup: gs://$BUCKET/data/$DATA built by $BUILD and uploaded by the first node, the first
#                  time only; every later launch finds its marker, gs://$BUCKET/data/$DATA.built
#   fetch_dataset  run: a local copy of it in data/$DATA, where study.py's experiment files look for it
#   job_torchrun   run: torchrun, whose exit code is its first failed rank's (torchrun's own is 1 whatever theirs)
#   job_exit       run, last: the exit code SkyPilot acts on: 0 done, 75 run again (recover_on_exit_codes),
#                  anything else stops the job (max_restarts_on_errors: 0)

RUN=${RUN:-$SKYPILOT_TASK_ID}
# A preemption notice is a SIGTERM to every process of the VM: the trainer saves a checkpoint and exits 0 before
# its end, study.py exits 1, pip in a setup dies. The shell waits for them, then says 75 (job_exit in a run, the
# exit trap in a setup), so that a job whose VM outlives the notice is run again rather than counted as done
# (exit 0) or failed (any other code).
STOPPED=
trap 'STOPPED=1' TERM INT
trap 'code=$?; [ -n "$STOPPED" ] && [ "$code" != 0 ] && exit 75' EXIT

# The bucket's name, checked before anything uses it: an empty one would make every URI gs:///... Exit code 1:
# the job is not run again.
if ! [[ ${BUCKET:-} =~ ^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$ ]]; then
  echo "job: BUCKET='${BUCKET:-}' is not a bucket name: --env BUCKET=NAME, the name alone (lowercase letters," \
    "digits, '-', '_', '.'; e.g. my-trm-bucket, not gs://my-trm-bucket)" >&2
  exit 1
fi

gcs_call() {
  # exists URI | get URI | put URI TEXT | fetch URI CACHE: exit code 0; 3 when the object is not there; any other
  # when the call failed: 2 when the bucket did not answer or refused or anything else went wrong (said on stderr
  # in one line), another code when Python itself did not run to its end
  python - "$@" <<'EOF'
import sys
from runkeep import gcs
what, uri, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
try:
    if what == 'exists':
        sys.exit(0 if gcs.object_exists(uri) else 3)
    if what == 'get':
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            gcs.download_file(uri, f'{tmp}/object')
            print(open(f'{tmp}/object').read())
    elif what == 'put':
        gcs.default_client().put(uri, rest[0].encode())
    elif what == 'fetch':
        print(gcs.fetch_tree(uri, rest[0]))
except gcs.NotFoundError:
    sys.exit(3)
except Exception as e:  # also what no one expected (a URI the client refuses, a marker that is not text)
    print(f"job: {what} {uri} failed: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
    sys.exit(2)
EOF
}

dataset_once() {
  [ "${SKYPILOT_SETUP_NODE_RANK:-0}" = 0 ] || return 0  # the other nodes read it from the bucket
  local uri="gs://$BUCKET/data/$DATA" built found=0
  built=$(gcs_call get "$uri.built") || found=$?
  if [ "$found" = 0 ]; then
    if [ "$built" != "$BUILD" ]; then
      echo "job: $uri was built by '$built', not by this job's BUILD '$BUILD': give DATA another name, or" \
        "delete $uri.built to build it again" >&2
      return 1
    fi
    echo "job: dataset $uri is there (built by: $built)"
    return 0
  elif [ "$found" != 3 ]; then  # a failed look is not an absent marker: building would replace the dataset
    echo "job: cannot tell whether $uri is built (reading $uri.built failed, exit code $found): not building" \
      "it; launch again once the bucket answers, or delete $uri.built if it is damaged" >&2
    return 1
  fi
  echo "job: building dataset $uri: $BUILD"
  $BUILD --output_dir "$uri" && gcs_call put "$uri.built" "$BUILD"
}

fetch_dataset() {
  local copy
  copy=$(gcs_call fetch "gs://$BUCKET/data/$DATA" ~/.cache/trm_data) || return 1
  mkdir -p "data/$(dirname "$DATA")" && ln -sfn "$copy" "data/$DATA"
}

job_torchrun() {
  # job_torchrun ARGS: `torchrun ARGS`, exiting with the code of the rank that failed first, so that the
  # watchdog's 75 (run again) and 70 (not) reach job_exit as they are; a rank a signal ended: 1
  python - "$@" <<'EOF'
import sys
from torch.distributed import run
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
sys.argv[0] = 'torchrun'  # the name its usage errors give (python -'s is '-')
try:
    run.main(sys.argv[1:])
except ChildFailedError as e:
    print(e, file=sys.stderr)  # torchrun's summary of the failures
    code = e.get_first_failure()[1].exitcode if e.failures else 1
    sys.exit(code if code > 0 else 1)
EOF
}

job_exit() {
  # job_exit CODE [URI]: CODE, the command's exit code; URI, the object a finished run leaves in the bucket
  # (without one, exit code 0 is the end)
  local code=$1 done_uri=${2:-} found=0
  if [ "$code" = 0 ] && [ -n "$done_uri" ]; then
    gcs_call exists "$done_uri" || found=$?
  fi
  if [ "$code" = 0 ] && [ "$found" = 0 ]; then
    echo "job: finished${done_uri:+ ($done_uri is there)}"
    return 0
  fi
  if [ "$code" = 0 ] && [ "$found" != 3 ]; then
    echo "job: cannot tell whether $done_uri is there (exit code $found): exiting with 75, which this task's" \
      "job_recovery runs again; a finished run's rerun finds it done"
    return 75
  fi
  if [ "$code" = 0 ] || [ -n "$STOPPED" ]; then
    echo "job: stopped before the end (exit code $code${STOPPED:+, after a SIGTERM or SIGINT}): exiting with" \
      "75, which this task's job_recovery runs again; it resumes from the last checkpoint"
    return 75
  fi
  if [ "$code" = 75 ]; then
    echo "job: exit code 75 (the watchdog: a rank made no progress): job_recovery runs it again"
  else
    echo "job: exit code $code: not run again (a config error, a crash, a failed run: the lines above say" \
      "which); after a fix, relaunch with --env RUN=$RUN to continue this run"
  fi
  return "$code"
}
