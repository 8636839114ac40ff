#!/usr/bin/env bash
# Mutation score of the modules that hold the invariants and the placement policy
# (docs/verification.md, section 5), with mutmut, on a fresh clone of the committed HEAD.
#
#   scripts/mutation.sh                 # every mutant of the modules below
#   MUTATION_WORKDIR=/tmp/m scripts/mutation.sh   # keep the clone, venv and results there
#   MUTATION_MAX_CHILDREN=2 ...         # parallel mutants (default: the number of cores)
#   MUTATION_MODULES="infrastructure/placing/batch.py" \
#   MUTATION_TESTS="tests/test_batch_races.py tests/test_batching.py" scripts/mutation.sh
#                                       # one module at a time, with the tests that matter
#   MUTATION_SAMPLE=60 MUTATION_SEED=1 ...  # a random sample of 60 mutants of each module
#                                       # (seeded; for runs that would take too long)
#
# It creates what it needs: a clone in a work directory, a virtual environment with the
# project's dependencies and its `test` and `mutation` extras (the project itself is not
# installed, so the tests can only import the mutated copy), then runs mutmut and prints
# the score. Not run by CI: it takes a while (docs/verification.md says how long).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WORK="${MUTATION_WORKDIR:-$(mktemp -d -t secondbox-mutation-XXXXXX)}"
CHILDREN="${MUTATION_MAX_CHILDREN:-$(nproc)}"
# Paths under the package (secondbox_scheduler/), as mutmut's only_mutate globs. (The
# list named domain/placement.py and domain/audit_fold.py until 2026-12-01: both had
# become packages, so the globs matched nothing and their mutants were never made.)
MODULES=(
  domain/placement/rules.py domain/placement/evidence.py domain/runner.py domain/sandbox.py
  domain/lease.py domain/audit/state.py domain/audit/runner_checks.py
  domain/audit/sandbox_checks.py domain/audit/fold.py
  domain/audit/chain.py
  infrastructure/placing/batch.py infrastructure/placing/batcher.py
  infrastructure/audit/verify.py infrastructure/audit/snapshot_check.py
  infrastructure/audit/log_fold.py infrastructure/audit/queries.py
  infrastructure/audit/whatif_replay.py
)
# The tests that pin these modules down; fast, SQLite only (the domain is store-agnostic).
# The last two read the release-0.1 history: the only callers of Sandbox.upcast_v1_v2
# (audit verify refolds the 0.1 snapshots through it).
# Left out for time (a surviving mutant runs every test that reaches it): PostgreSQL
# twins, the simulate-then-audit test and the three 300-example placement properties,
# so the score is a lower bound of what the whole suite kills.
TESTS=(
  tests/test_runner_guards.py tests/test_sandbox_guards.py tests/test_audit_fold.py
  tests/test_completeness_audit.py
  tests/test_domain_records.py tests/test_evidence.py
  tests/test_placement.py tests/test_application_guards.py tests/test_audit.py
  tests/test_lifecycle.py tests/test_schedule.py tests/test_runners.py tests/test_reconcile.py
  tests/test_bounded_state.py tests/test_fixture_history.py
  tests/test_batch_races.py tests/test_batching.py tests/test_races.py
  tests/test_concurrency.py tests/test_tamper.py tests/test_whatif.py
)
if [ -n "${MUTATION_MODULES:-}" ]; then read -r -a MODULES <<< "$MUTATION_MODULES"; fi
if [ -n "${MUTATION_TESTS:-}" ]; then read -r -a TESTS <<< "$MUTATION_TESTS"; fi

echo "mutation run in $WORK" >&2
rm -rf "$WORK/clone"
git clone --quiet --no-hardlinks "$ROOT" "$WORK/clone"
cd "$WORK/clone"

if [ ! -x "$WORK/venv/bin/mutmut" ]; then
  "$PYTHON" -m venv "$WORK/venv"
  "$WORK/venv/bin/pip" install --quiet --disable-pip-version-check ".[test,mutation]"
fi
"$WORK/venv/bin/pip" uninstall --quiet --yes secondbox-scheduler >/dev/null 2>&1 || true

# In a checkout, secondbox_scheduler/domain (and the other layers) are symbolic links to
# the top-level folders. mutmut walks real directories only and names each mutant by its
# module path, so the clone gets the installed layout: each layer moved into the package.
for layer in domain projections infrastructure; do
  rm "secondbox_scheduler/$layer"
  mv "$layer" "secondbox_scheduler/$layer"
done

{
  echo "[mutmut]"
  echo "source_paths = secondbox_scheduler"
  echo "only_mutate ="
  for module in "${MODULES[@]}"; do echo "    secondbox_scheduler/$module"; done
  echo "pytest_add_cli_args_test_selection ="
  for test in "${TESTS[@]}"; do echo "    $test"; done
  echo "pytest_add_cli_args ="
  echo "    -p"
  echo "    no:cacheprovider"
  echo "    -k"
  echo "    not postgres and not simulate and not test_select_runner_is_deterministic and not test_chosen_runner_is_compatible and not test_home_selection_sees_only"
  echo "    -m"
  echo "    not slow"
} > setup.cfg

export SECONDBOX_HYPOTHESIS_PROFILE=ci
started=$(date +%s)
SAMPLED=()
if [ -n "${MUTATION_SAMPLE:-}" ]; then
  # Make every mutant and the test statistics, and check none: mutmut checks only the
  # mutants named on its command line, and stops (after making them, with "nothing
  # matches") when a name matches none. Then check a seeded random sample of each
  # module's mutants: the score is the sample's.
  if "$WORK/venv/bin/mutmut" run --max-children "$CHILDREN" "no-such-mutant" \
    > "$WORK/mutmut-generate.log" 2>&1 || ! grep -q "nothing matches" "$WORK/mutmut-generate.log"; then
    tail -n 40 "$WORK/mutmut-generate.log" >&2
    exit 1
  fi
  "$WORK/venv/bin/mutmut" results --all true > "$WORK/all-mutants.txt" 2>&1 || true
  "$WORK/venv/bin/python" "$ROOT/scripts/mutation_score.py" --sample "$WORK/all-mutants.txt" \
    "$MUTATION_SAMPLE" "${MUTATION_SEED:-1}" "${MODULES[@]}" > "$WORK/sample.txt"
  mapfile -t SAMPLED < "$WORK/sample.txt"
  echo "checking ${#SAMPLED[@]} sampled mutants (list: $WORK/sample.txt)" >&2
fi
"$WORK/venv/bin/mutmut" run --max-children "$CHILDREN" "${SAMPLED[@]}" \
  > "$WORK/mutmut-run.log" 2>&1 || {
  tail -n 40 "$WORK/mutmut-run.log" >&2
  exit 1
}
seconds=$(( $(date +%s) - started ))
"$WORK/venv/bin/mutmut" results --all true > "$WORK/results.txt" 2>&1 || true
"$WORK/venv/bin/python" "$ROOT/scripts/mutation_score.py" "$WORK/results.txt" \
  "$ROOT/docs/equivalent-mutants.txt" "$seconds" ${SAMPLED:+"$WORK/sample.txt"}
