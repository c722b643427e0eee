#!/usr/bin/env bash
# Runs one real step of dagster-rl on the cluster KUBECONFIG points at, through the deployment in
# deploy/ (Helm release, PVC, RBAC): the experiment deploy/smoke/smoke_k8s.yaml (the tiny built-in
# model, no GPU, no download) is copied to the shared volume, the code location reloads, and one
# run of its step 0000 is launched through the instance's queue (daemon -> K8sRunLauncher -> run
# pod -> step pod -> trainer Job of 2 pods). Exits 0 when step 0000 is materialized.
#
#   KUBECONFIG=~/.kube/config NAMESPACE=dagster-rl RELEASE=dagster deploy/smoke-test.sh
#
# Needs kubectl, and a release installed as docs/kubernetes.md says.
set -euo pipefail

NAMESPACE="${NAMESPACE:-dagster-rl}"
RELEASE="${RELEASE:-dagster}"
LOCATION="${LOCATION:-dagster-rl}"        # the user code deployment's name in deploy/helm/values.yaml
TIMEOUT_S="${TIMEOUT_S:-1800}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
k() { kubectl -n "$NAMESPACE" "$@"; }

command -v kubectl >/dev/null || { echo "smoke-test: kubectl is not on PATH" >&2; exit 2; }
kubectl version >/dev/null || { echo "smoke-test: no cluster at KUBECONFIG=${KUBECONFIG:-~/.kube/config}" >&2; exit 2; }

echo "== the deployment in $NAMESPACE"
k get pvc dagster-rl-shared >/dev/null || { echo "smoke-test: no PVC dagster-rl-shared: kubectl -n $NAMESPACE apply -f deploy/k8s/storage.yaml" >&2; exit 1; }
k get role dagster-rl-trainer-launcher >/dev/null || { echo "smoke-test: no RBAC: kubectl -n $NAMESPACE apply -f deploy/k8s/rbac.yaml" >&2; exit 1; }
DEPLOYMENT="$(k get deployment -l "deployment=$LOCATION" -o name | head -n1)"
[ -n "$DEPLOYMENT" ] || { echo "smoke-test: no user code deployment $LOCATION: helm upgrade --install $RELEASE dagster/dagster -f deploy/helm/values.yaml" >&2; exit 1; }
k rollout status "$DEPLOYMENT" --timeout=300s

echo "== the account the runs use, and what it may do"
# Run and step pods run as the account in the code location's container context (the chart sets it
# from global.serviceAccountName); the driver, in a step pod, creates the trainer's Jobs and Services.
CONTEXT="$(k get "$DEPLOYMENT" -o jsonpath='{.spec.template.spec.containers[0].env[?(@.name=="DAGSTER_CLI_API_GRPC_CONTAINER_CONTEXT")].value}')"
RUN_SA="$(printf '%s' "$CONTEXT" | sed -n 's/.*"service_account_name": *"\([^"]*\)".*/\1/p')"
[ -n "$RUN_SA" ] || RUN_SA="$(k get "$DEPLOYMENT" -o jsonpath='{.spec.template.spec.serviceAccountName}')"
echo "runs and steps run as: $RUN_SA"
missing=""
for check in "create services" "patch services" "delete services" "create jobs.batch" "get jobs.batch" "list jobs.batch" \
             "delete jobs.batch" "get jobs.batch/status" "list pods" "delete pods" "get pods/log" \
             "create networkpolicies.networking.k8s.io" "patch networkpolicies.networking.k8s.io" \
             "delete networkpolicies.networking.k8s.io" "create pods" "get pods" "patch pods" "create pods/exec"; do
  # shellcheck disable=SC2086 # "verb resource" splits into its two words on purpose
  if [ "$(kubectl auth can-i $check -n "$NAMESPACE" --as="system:serviceaccount:$NAMESPACE:$RUN_SA" 2>/dev/null)" != "yes" ]; then
    missing="$missing
  $check"
  fi
done
if [ -n "$missing" ]; then
  cat >&2 <<EOF
smoke-test: the runs' service account $NAMESPACE/$RUN_SA may not:$missing
Every trainer step (and every sandbox pod) would fail with HTTP 403. Fix:
  - set global.serviceAccountName: dagster-rl in deploy/helm/values.yaml (the runs then run as the
    account deploy/k8s/rbac.yaml binds) and helm upgrade the release; or bind $RUN_SA instead;
  - kubectl -n $NAMESPACE apply -f deploy/k8s/rbac.yaml
EOF
  exit 1
fi
k get serviceaccount dagster-rl-trainer >/dev/null || { echo "smoke-test: no service account dagster-rl-trainer for the trainer pods: kubectl -n $NAMESPACE apply -f deploy/k8s/rbac.yaml" >&2; exit 1; }
k get serviceaccount dagster-rl-sandbox >/dev/null || { echo "smoke-test: no service account dagster-rl-sandbox for the sandbox pods: kubectl -n $NAMESPACE apply -f deploy/k8s/sandbox.yaml" >&2; exit 1; }

echo "== the smoke experiment, on the shared volume; the code location reloads"
POD="$(k get pod -l "deployment=$LOCATION" -o jsonpath='{.items[0].metadata.name}')"
k exec "$POD" -- mkdir -p /data/experiments
k cp "$HERE/smoke/smoke_k8s.yaml" "$POD:/data/experiments/smoke_k8s.yaml"
k rollout restart "$DEPLOYMENT"
k rollout status "$DEPLOYMENT" --timeout=300s
POD="$(k get pod -l "deployment=$LOCATION" --field-selector=status.phase=Running -o jsonpath='{.items[0].metadata.name}')"
sleep 20  # the webserver and the daemon pick up the reloaded location

echo "== launch step 0000 (queued; the daemon starts it)"
k exec "$POD" -- sh -c "cat > /tmp/smoke-workspace.yaml <<YAML
load_from:
  - grpc_server: {host: $LOCATION, port: 3030, location_name: $LOCATION}
YAML
dagster job launch -w /tmp/smoke-workspace.yaml -l $LOCATION -j smoke_k8s_train \
  --tags '{\"dagster/asset_partition_range_start\": \"0000\", \"dagster/asset_partition_range_end\": \"0000\"}'"

echo "== wait for step 0000 (trainer pods: kubectl -n $NAMESPACE get jobs,pods -l app.kubernetes.io/name=dagster-rl)"
deadline=$(( $(date +%s) + TIMEOUT_S ))
while true; do
  status="$(k exec "$POD" -- dagster-rl status smoke_k8s || true)"
  if printf '%s\n' "$status" | grep -Eq '^0000 +materialized'; then
    printf '%s\n' "$status"
    echo "smoke-test: OK - step 0000 of smoke_k8s trained by the trainer Job's 2 pods"
    exit 0
  fi
  if [ "$(date +%s)" -gt "$deadline" ]; then
    printf '%s\n' "$status"
    k get jobs,pods -l app.kubernetes.io/name=dagster-rl || true
    echo "smoke-test: FAILED - step 0000 not materialized after ${TIMEOUT_S}s; see the run in the UI (kubectl -n $NAMESPACE port-forward svc/$RELEASE-dagster-webserver 3000:80)" >&2
    exit 1
  fi
  sleep 15
done
