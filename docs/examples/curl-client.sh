#!/usr/bin/env bash
# A SecondBox scheduler client in curl: one sandbox from registration to release.
#
#   bash docs/examples/curl-client.sh [BASE_URL]      (default http://127.0.0.1:8080)
#   RUNNER=runner-7 SANDBOX=sbx-42 bash docs/examples/curl-client.sh
#   TOKEN=sbt_... bash docs/examples/curl-client.sh   (a control-plane token, once any exists)
#
# Registers (or re-registers, idempotently) a runner and heartbeats it, creates a
# sandbox, schedules its current generation (and sends the same request again: a
# replay), reports it running, releases it with proof and advances the generation.
# Every request prints "METHOD PATH -> STATUS" and the answer. A 503 is retried after
# its Retry-After; any other failure stops the script (exit 1). Needs bash, curl, GNU date
# and od.
set -euo pipefail
BASE=${1:-http://127.0.0.1:8080}
RUNNER=${RUNNER:-runner-1}
SANDBOX=${SANDBOX:-sbx-$RANDOM$RANDOM}
auth=()
if [ -n "${TOKEN:-}" ]; then auth=(-H "Authorization: Bearer $TOKEN"); fi
body=$(mktemp) headers=$(mktemp)
trap 'rm -f "$body" "$headers"' EXIT

call() {  # call METHOD PATH [JSON]: print the answer; the status is left in $status
  local attempt
  for attempt in 1 2 3 4 5 6 7 8 9 10; do
    status=$(curl -sS -o "$body" -D "$headers" -w '%{http_code}' -X "$1" \
      -H 'content-type: application/json' ${auth[@]+"${auth[@]}"} ${3:+--data "$3"} "$BASE$2")
    echo "$1 $2 -> $status"; cat "$body"; echo
    [ "$status" != 503 ] && return 0
    sleep "$(sed -n 's/^retry-after: *\([0-9]*\).*/\1/Ip' "$headers" | tr -d '\r')"
  done
}
field() {  # field NAME: a string field of the last answer
  sed -n "s/.*\"$1\":\"\([^\"]*\)\".*/\1/p" "$body"
}
expect() { case " $* " in *" $status "*) ;; *) echo "unexpected status $status" >&2; exit 1 ;; esac; }

# Times are taken just before each request: the scheduler's clock refuses a "now" more
# than its tolerance (5 s by default) away from its own.
now() { date -u +%Y-%m-%dT%H:%M:%S.%3NZ; }
later() { date -u -d "+$1" +%Y-%m-%dT%H:%M:%SZ; }
token=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')   # 32 random bytes, hex
requirements='{"pool_name":"general","architecture":"x86_64","guest_protocol_generation":2,
  "capacity":{"vcpu_count":2,"memory_bytes":4294967296,"disk_bytes":10737418240,"instances":1,"operations":1},
  "preferred_artifact_digests":["sha256:rt","sha256:tc"]}'

call POST /v1/runners "{\"runner_id\":\"$RUNNER\",\"pool_name\":\"general\",
  \"backend_kind\":\"firecracker\",\"architecture\":\"x86_64\",
  \"capabilities\":[\"compute\",\"network-policy\",\"storage\",\"cleanup\",\"local-workspace\"],
  \"allocatable\":{\"vcpu_count\":32,\"memory_bytes\":137438953472,\"disk_bytes\":1099511627776,
  \"instances\":16,\"operations\":64},\"guest_protocol_minimum\":1,\"guest_protocol_maximum\":3}"
expect 200 201
call POST "/v1/runners/$RUNNER/heartbeat" "{\"at\":\"$(now)\",\"artifact_digests\":[\"sha256:rt\"],
  \"materializations\":[{\"backend_kind\":\"firecracker\",\"architecture\":\"x86_64\",
  \"runtime_digest\":\"sha256:rt\",\"toolchain_digest\":\"sha256:tc\",\"digest\":\"sha256:m\"}]}"
expect 200
call POST /v1/sandboxes "{\"sandbox_id\":\"$SANDBOX\",\"workspace_id\":\"ws-$SANDBOX\",
  \"profile_revision_id\":\"rev-1\",\"requirements\":$requirements,\"heartbeat_timeout_seconds\":30}"
expect 200 201
at=$(now)
schedule="{\"assignment_id\":\"asg-$SANDBOX-1\",\"assignment_command_id\":\"cmd-$SANDBOX-1\",
  \"instance_id\":\"inst-$SANDBOX\",\"workspace_id\":\"ws-$SANDBOX\",\"start_mutation_id\":\"mut-$SANDBOX-1\",
  \"profile_revision_id\":\"rev-1\",\"requirements\":$requirements,\"fencing_token\":\"$token\",
  \"claim_expires_at\":\"$(later '5 minutes')\",\"operation_deadline\":\"$(later '10 minutes')\",
  \"retry_limit\":3,\"heartbeat_timeout_seconds\":30,
  \"now\":\"$at\",\"effect_started_at\":\"$at\",\"plan_ready_at\":\"$at\"}"
call POST "/v1/sandboxes/$SANDBOX/schedule" "$schedule"
expect 200 201
call POST "/v1/sandboxes/$SANDBOX/schedule" "$schedule"   # a retry: the same assignment
expect 200
generation=$(sed -n 's/.*"generation":\([0-9]*\).*/\1/p' "$body")
token=$(field fencing_token)   # the assignment's own token (ours, unless it existed already)
fence="{\"fencing_token\":\"$token\"}"
call POST "/v1/sandboxes/$SANDBOX/generations/$generation/running" "$fence"
expect 200
call POST "/v1/sandboxes/$SANDBOX/generations/$generation/release" \
  "{\"fencing_token\":\"$token\",\"release_proof\":{\"stopped\":\"$(now)\"}}"
expect 200
call POST "/v1/sandboxes/$SANDBOX/generations/$generation/advance"
expect 200
