# Helpers for the run scripts: start the services a run needs, wait until they answer, and on exit stop exactly
# the processes this script started (by PID; never by name). Source it, then call the functions.

STARTED_PIDS=()
RAY_HEAD_PORT=""  # the port of the Ray head start_ray_head started, if it did

stop_started() {
   local pid
   for pid in "${STARTED_PIDS[@]}"; do
      kill -TERM "${pid}" 2>/dev/null || true
   done
   for pid in "${STARTED_PIDS[@]}"; do
      wait "${pid}" 2>/dev/null || true
   done
   STARTED_PIDS=()
   forget_ray_head
}

# forget_ray_head: `ray start` writes the head's address to RAY_TMP/ray_current_cluster and nothing removes it when the
# head stops; every later ray.init() on this machine without an address would then try to join the stopped head (and
# hang retrying). Removed here when it still names the head this script started.
forget_ray_head() {
   local file="${RAY_TMPDIR:-${TMPDIR:-/tmp}}/ray/ray_current_cluster"
   if [[ -n "${RAY_HEAD_PORT}" && -f "${file}" ]] && grep -q ":${RAY_HEAD_PORT}\$" "${file}"; then
      rm -f "${file}"
   fi
   RAY_HEAD_PORT=""
}
DRIVER_PID=""

# run_driver ARGS...: run the training (or eval) driver in the background and wait for it. Bash runs a trap only
# between foreground commands, so a driver in the foreground would leave INT/TERM unanswered until it finished;
# in the background it gets the signal at once, and its own shutdown stops its engines, its Ray actors and a Ray
# cluster it started, before this script stops the services it started itself.
# A driver that dies without its shutdown (SIGKILL, the kernel's OOM killer) leaves Ray's agents running; the driver
# records the processes it started in its run folder (--save), and what is left of them is stopped here, by PID and
# start time (slime_search/ray/session.py).
run_driver() {
   local save="" arg previous=""
   for arg in "$@"; do
      [[ "${previous}" == "--save" ]] && save=${arg}
      previous=${arg}
   done
   "$@" &
   DRIVER_PID=$!
   local status=0
   wait "${DRIVER_PID}" || status=$?
   DRIVER_PID=""
   if [[ -n "${save}" && -f "${save}/ray_processes.json" ]]; then
      python3 -m slime_search.ray.session stop "${save}/ray_processes.json" || true
   fi
   return "${status}"
}

stop_driver() {
   if [[ -n "${DRIVER_PID}" ]] && kill -0 "${DRIVER_PID}" 2>/dev/null; then
      kill -TERM "${DRIVER_PID}" 2>/dev/null || true
      wait "${DRIVER_PID}" 2>/dev/null || true
   fi
}
trap stop_started EXIT
trap 'stop_driver; exit 130' INT TERM

# wait_http URL SECONDS PID: poll URL until it answers 200, failing early if process PID has exited.
wait_http() {
   local url=$1 seconds=$2 pid=$3 waited=0
   until python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "${url}" 2>/dev/null; do
      if ! kill -0 "${pid}" 2>/dev/null; then
         echo "process ${pid} exited before ${url} answered" >&2
         return 1
      fi
      if (( waited >= seconds )); then
         echo "${url} did not answer within ${seconds} s" >&2
         return 1
      fi
      sleep 1
      waited=$((waited + 1))
   done
}

# start_retriever PORT LOG ARGS...: the retrieval server on 127.0.0.1:PORT; sets SEARCH_URL.
start_retriever() {
   local port=$1 log=$2
   shift 2
   python3 "${REPO_ROOT}/local_dense_retriever/retrieval_server.py" --host 127.0.0.1 --port "${port}" "$@" \
      >"${log}" 2>&1 &
   STARTED_PIDS+=($!)
   echo "retriever (pid $!) starting; log: ${log}"
   wait_http "http://127.0.0.1:${port}/health" "${RETRIEVER_START_TIMEOUT:-1800}" "$!"
   SEARCH_URL="http://127.0.0.1:${port}/retrieve"
}

# start_ray_head PORT NUM_GPUS LOG: a Ray head in the foreground of a background job (--block), so stopping that
# one PID stops the Ray processes it started; sets RAY_ADDRESS for the driver.
start_ray_head() {
   local port=$1 gpus=$2 log=$3
   # Ray (2.60 here) turns token authentication on for a head where a token exists (~/.ray/auth_token, which any
   # earlier local ray.init() leaves), but its CLI and drivers send the token only when RAY_AUTH_MODE says so: without
   # this, `ray status` and the driver are refused by the head they started.
   if [[ -z "${RAY_AUTH_MODE:-}" && ( -n "${RAY_AUTH_TOKEN:-}" || -f "${RAY_AUTH_TOKEN_PATH:-${HOME}/.ray/auth_token}" ) ]]; then
      export RAY_AUTH_MODE=token
   fi
   ray start --head --block --node-ip-address 127.0.0.1 --port "${port}" --num-gpus "${gpus}" \
      --include-dashboard false --disable-usage-stats >"${log}" 2>&1 &
   STARTED_PIDS+=($!)
   RAY_HEAD_PORT=${port}
   local pid=$! waited=0
   until ray status --address "127.0.0.1:${port}" >/dev/null 2>&1; do
      if ! kill -0 "${pid}" 2>/dev/null || (( waited >= 120 )); then
         echo "Ray head did not start; log: ${log}" >&2
         return 1
      fi
      sleep 1
      waited=$((waited + 1))
   done
   export RAY_ADDRESS="127.0.0.1:${port}"
   echo "Ray head (pid ${pid}) at ${RAY_ADDRESS}"
}

# run_or_print ARGS...: run the driver command (run_driver), or with DRY_RUN=1 print it one argument per line.
run_or_print() {
   if [[ "${DRY_RUN:-0}" == "1" ]]; then
      printf '%s\n' "$@"
   else
      run_driver "$@"
   fi
}
