#!/usr/bin/env bash
# Launch a whole bucketrl run across clouds with SkyPilot, from this repository's root, in one command:
#
#   export BUCKETRL_BUCKET_URL=s3://my-bucket/rl AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...
#   deploy/skypilot/up.sh
#
# 1. the control plane (control-plane.yaml) and a relay in each generator region (relay.yaml): SkyPilot clusters,
#    provisioned and installed in parallel;
# 2. the run's CA and a server certificate for each of their addresses (certs.sh; the CA key stays in $CERTS);
# 3. the control plane and the relays started with their certificates and secrets (sky exec);
# 4. the job group run.yaml: the trainer and the generators, as managed jobs.
#
# Tokens are made once and kept in $CERTS/tokens.env (mode 600); rerunning reuses them and the CA. The relays get
# a `relay` token of their own (RELAY_TOKEN; it reads staged uploads only), so staged publish is on. Every secret
# goes to SkyPilot as --secret NAME, read from this shell's environment: none is written into a YAML file.
# Settings: CONTROL (cluster name, default bucketrl-control), RELAYS ("name=cloud/region ...": the regions of
# run.yaml's generator tasks), CERTS (default ~/.bucketrl/skypilot), BUCKETRL_S3_ENDPOINT_URL (non-AWS buckets).
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${BUCKETRL_BUCKET_URL:?set BUCKETRL_BUCKET_URL=s3://bucket/prefix}"
: "${AWS_ACCESS_KEY_ID:?set AWS_ACCESS_KEY_ID (the bucket credentials, for the control plane alone)}"
: "${AWS_SECRET_ACCESS_KEY:?set AWS_SECRET_ACCESS_KEY}"
CONTROL=${CONTROL:-bucketrl-control}
RELAYS=${RELAYS:-"bucketrl-relay-aws=aws/us-east-2 bucketrl-relay-gcp=gcp/us-central1"}
CERTS=${CERTS:-$HOME/.bucketrl/skypilot}
SKY=${SKY:-sky}
here=deploy/skypilot
bucket_env=(--env "BUCKETRL_BUCKET_URL=$BUCKETRL_BUCKET_URL" --env "BUCKETRL_S3_ENDPOINT_URL=${BUCKETRL_S3_ENDPOINT_URL:-}")

mkdir -p "$CERTS" && chmod 700 "$CERTS"
if [ ! -s "$CERTS/tokens.env" ]; then
  mask=$(umask) && umask 077
  for role in ADMIN TRAINER GENERATOR VIEWER; do
    echo "${role}_TOKEN=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"
  done > "$CERTS/tokens.env"
  umask "$mask"
fi
if ! grep -q '^RELAY_TOKEN=' "$CERTS/tokens.env"; then  # tokens.env from before the relays had one
  echo "RELAY_TOKEN=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')" >> "$CERTS/tokens.env"
fi
set -a && . "$CERTS/tokens.env" && set +a
export BUCKETRL_TOKENS="admin:$ADMIN_TOKEN,trainer:$TRAINER_TOKEN,generator:$GENERATOR_TOKEN,viewer:$VIEWER_TOKEN"
BUCKETRL_TOKENS+=",relay:$RELAY_TOKEN"
export RELAY_STAGING_TOKEN=$RELAY_TOKEN

echo "== 1. machines: $CONTROL and the relays"
pids=()
# Every secret a recipe names must be given at launch: the certificates empty for now (the run then stops).
$SKY launch -y -c "$CONTROL" "$here/control-plane.yaml" "${bucket_env[@]}" --secret BUCKETRL_TOKENS \
  --secret TLS_CERT_PEM= --secret TLS_KEY_PEM= --secret AWS_ACCESS_KEY_ID --secret AWS_SECRET_ACCESS_KEY & pids+=($!)
for relay in $RELAYS; do
  $SKY launch -y -c "${relay%%=*}" --infra "${relay#*=}" "$here/relay.yaml" --env PROXY_URL=https://pending \
    --secret CA_PEM= --secret RELAY_CERT_PEM= --secret RELAY_KEY_PEM= & pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done

echo "== 2. certificates"
"$here/certs.sh" ca "$CERTS"
control_ip=$($SKY status --ip "$CONTROL")
"$here/certs.sh" server "$CERTS" proxy "$control_ip"
PROXY_URL="https://$control_ip:8443"
relay_urls=""
for relay in $RELAYS; do
  ip=$($SKY status --ip "${relay%%=*}")
  "$here/certs.sh" server "$CERTS" "${relay%%=*}" "$ip"
  relay_urls+="${relay#*=}=https://$ip:8444 "
done
export CA_PEM; CA_PEM=$(cat "$CERTS/ca.pem")

echo "== 3. control plane at $PROXY_URL, relays: $relay_urls"
TLS_CERT_PEM=$(cat "$CERTS/proxy.pem") TLS_KEY_PEM=$(cat "$CERTS/proxy.key") \
  $SKY exec -d "$CONTROL" "$here/control-plane.yaml" "${bucket_env[@]}" \
  --secret BUCKETRL_TOKENS --secret TLS_CERT_PEM --secret TLS_KEY_PEM \
  --secret AWS_ACCESS_KEY_ID --secret AWS_SECRET_ACCESS_KEY
for relay in $RELAYS; do
  RELAY_CERT_PEM=$(cat "$CERTS/${relay%%=*}.pem") RELAY_KEY_PEM=$(cat "$CERTS/${relay%%=*}.key") \
    $SKY exec -d "${relay%%=*}" "$here/relay.yaml" --env "PROXY_URL=$PROXY_URL" \
    --secret CA_PEM --secret RELAY_CERT_PEM --secret RELAY_KEY_PEM --secret RELAY_STAGING_TOKEN
done

echo "== 4. trainer and generators"
$SKY jobs launch -y -d "$here/run.yaml" --env "PROXY_URL=$PROXY_URL" --env "RELAY_URLS=${relay_urls% }" \
  --secret TRAINER_TOKEN --secret GENERATOR_TOKEN --secret CA_PEM

cat <<DONE
Launched. Watch it:
  BUCKETRL_PROXY_URL=$PROXY_URL BUCKETRL_CA_FILE=$CERTS/ca.pem BUCKETRL_TOKEN=\$VIEWER_TOKEN bucketrl status --run rl-1
  sky jobs queue
(the tokens are in $CERTS/tokens.env). More generators: docs/across-clouds.md, "Adding generators".
DONE
