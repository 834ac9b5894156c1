#!/usr/bin/env bash
# Start N processes of `python -m mlm_jax.train` on this machine, joined through a coordinator on a free local
# port: a multi-host run in miniature, and the way to test one on CPU.
#
#   scripts/launch_local.sh N [train arguments ...]
#   XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \
#     scripts/launch_local.sh 2 parallel.fsdp=8 train.steps=10
#
# Every output line is prefixed with "[i] " (stdout stays stdout, stderr stays stderr). Exits 0 when all
# processes succeed, otherwise with the first failing process's code. Ctrl-C or TERM sends TERM to all of them
# (KILL after $GRACE_S seconds, default 30). PYTHON picks the interpreter (default: python).
set -u -m  # -m: each process and its prefixers in a process group of their own, to signal them together

if [[ $# -lt 1 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 NUM_PROCESSES [python -m mlm_jax.train arguments ...]" >&2
  exit 2
fi
n=$1
shift
python=${PYTHON:-python}
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])') || exit 1

pids=()
stop() {
  trap - INT TERM
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
  for ((t = 0; t < ${GRACE_S:-30}; t++)); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive)) || exit 130
    sleep 1
  done
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
  exit 130
}
trap stop INT TERM

for ((i = 0; i < n; i++)); do
  # Gloo (the CPU collectives) reports every connection it makes, from several threads at once: dropped, and
  # with them the empty and digits-only lines their interleaved writes leave behind.
  prefix=(sed -u -e '/\[Gloo\]/d' -e '/connected peer ranks is : [0-9]*$/d' -e '/^[0-9]*$/d' -e "s/^/[$i] /")
  (
    set -o pipefail  # the group's status is python's
    trap '' INT TERM  # a stop is for python; the prefixers pass on its last words, then end with its output
    { { trap - INT TERM
        exec "$python" -u -m mlm_jax.train --coordinator "127.0.0.1:$port" --num-processes "$n" --process-id "$i" "$@"
      } 2>&1 1>&3 3>&- | "${prefix[@]}" >&2; } 3>&1 | "${prefix[@]}"
  ) &
  pids+=($!)
done

status=0
for pid in "${pids[@]}"; do
  wait "$pid"
  code=$?
  ((code != 0 && status == 0)) && status=$code
done
exit $status
