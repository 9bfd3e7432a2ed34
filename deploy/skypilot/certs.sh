#!/usr/bin/env bash
# The run's own certificate authority and the server certificates it signs (openssl only; nothing leaves this
# machine). The CA key stays here: the VMs get a server certificate and key (the control plane, each relay) or the
# CA certificate (every worker, to verify them), as SkyPilot secrets.
#
#   deploy/skypilot/certs.sh ca DIR                       # DIR/ca.pem, DIR/ca.key (kept if they exist)
#   deploy/skypilot/certs.sh server DIR NAME ADDRESS...   # DIR/NAME.pem, DIR/NAME.key for these IPs / DNS names
#
# A server certificate names every address a worker dials (subjectAltName), valid for 90 days.
set -euo pipefail
umask 077

ca() {
  local dir=$1
  mkdir -p "$dir"
  [ -s "$dir/ca.pem" ] && [ -s "$dir/ca.key" ] && return 0
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 365 \
    -subj "/CN=bucketrl run CA" -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" -keyout "$dir/ca.key" -out "$dir/ca.pem" 2>/dev/null
}

server() {
  local dir=$1 name=$2
  shift 2
  [ $# -gt 0 ] || { echo "certs.sh server: name at least one address for $name" >&2; exit 2; }
  [ -s "$dir/ca.pem" ] || { echo "certs.sh server: no CA in $dir (run: certs.sh ca $dir)" >&2; exit 2; }
  local san="" a
  for a in "$@"; do
    if [[ $a =~ ^[0-9.]+$ || $a == *:* ]]; then san+="IP:$a,"; else san+="DNS:$a,"; fi
  done
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$1" \
    -keyout "$dir/$name.key" -out "$dir/$name.csr" 2>/dev/null
  openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial -days 90 \
    -extfile <(printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n' "${san%,}") \
    -out "$dir/$name.pem" 2>/dev/null
  rm -f "$dir/$name.csr"
}

case "${1:-}" in
  ca) [ $# -eq 2 ] || { echo "usage: certs.sh ca DIR" >&2; exit 2; }; ca "$2" ;;
  server) [ $# -ge 3 ] || { echo "usage: certs.sh server DIR NAME ADDRESS..." >&2; exit 2; }; server "${@:2}" ;;
  *) echo "usage: certs.sh ca DIR | certs.sh server DIR NAME ADDRESS..." >&2; exit 2 ;;
esac
