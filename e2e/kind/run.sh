#!/usr/bin/env bash
# kaon on kind with GPUs (see README.md here). Not runnable on the development machines.
set -euo pipefail
cd "$(dirname "$0")/../.."
CLUSTER=kaon
if [[ "${1:-}" == "--delete" ]]; then kind delete cluster --name "$CLUSTER"; exit 0; fi

kind create cluster --name "$CLUSTER" --config e2e/kind/cluster.yaml
kubectl apply -f https://raw.githubusercontent.com/NVIDIA/k8s-device-plugin/v0.17.1/deployments/static/nvidia-device-plugin.yml
kubectl wait --for=condition=Ready nodes --all --timeout=300s

docker build -t kaon/runtime:dev -f runtime/Dockerfile .
docker build -t kaon/operator:dev -f operator/Dockerfile .
kind load docker-image --name "$CLUSTER" kaon/runtime:dev kaon/operator:dev

helm install kaon charts/kaon -n kaon-system --create-namespace \
  --set image.repository=kaon/operator --set image.tag=dev --wait
sed 's|^  replicas: 1|  replicas: 1\n  engine:\n    image: kaon/runtime:dev|' examples/smollm2.yaml | kubectl apply -f -
kubectl wait --for=condition=Ready infsvc/smollm2 --timeout=900s

kubectl -n kaon-system port-forward svc/kaon-router 8080:80 >/dev/null &
trap 'kill %1 2>/dev/null || true' EXIT
sleep 3
curl -s http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{"model": "smollm2", "max_tokens": 32, "messages": [{"role": "user", "content": "What is the capital of France?"}]}'
echo

kubectl patch infsvc smollm2 --type=merge -p '{"spec": {"engine": {"maxNumSeqs": 2}, "autoscaling": {"enabled": true,
  "minReplicas": 1, "maxReplicas": 3, "targetQueueDepthPerReplica": 2, "scaleUpWindowSeconds": 2,
  "scaleDownStabilizationSeconds": 30}}}'
python3 - <<'PY'
import concurrent.futures, time
from openai import OpenAI
client = OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="-")
def call(i):
    return client.completions.create(model="smollm2", prompt=f"Story {i}:", max_tokens=64).choices[0].finish_reason
with concurrent.futures.ThreadPoolExecutor(16) as pool:
    print(list(pool.map(call, range(64))))
PY
until kubectl describe infsvc smollm2 | grep -q "Scaled up"; do sleep 2; done
until kubectl describe infsvc smollm2 | grep -q "Scaled down"; do sleep 5; done
kubectl describe infsvc smollm2

if kubectl apply -f - <<'YAML' 2>/dev/null; then echo "invalid spec was accepted"; exit 1; fi
apiVersion: kaon.dev/v1alpha1
kind: InferenceService
metadata: {name: bad}
spec: {model: {uri: builtin://smollm2-135m-instruct}, replicas: -1}
YAML
kubectl delete infsvc smollm2 --wait=true
test -z "$(kubectl get deploy,svc,pdb,pods -l kaon.dev/inferenceservice=smollm2 -o name)"
echo "kind scenario passed"
