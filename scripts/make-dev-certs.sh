#!/usr/bin/env bash
# Makes a throwaway CA and certificates for trying TLS and mutual TLS (and for the tests):
#   ca.pem                      the CA every process trusts (--tls-ca)
#   server.pem, server.key      for every preft process (SAN: 127.0.0.1, localhost, $PREFT_CERT_SANS)
#   client.pem, client.key      a client of the cluster (preft client --tls-cert/--tls-key)
#   rogue-ca.pem, rogue.pem, rogue.key   a second CA and a client it signed (must be refused)
# Usage: scripts/make-dev-certs.sh DIR [DAYS]   (real clusters: use your PKI or cert-manager)
set -euo pipefail
dir=$1
days=${2:-2}
mkdir -p "$dir"
cd "$dir"
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 -out "$1" 2>/dev/null; }
ca() {  # NAME CN
  key "$1.key"
  openssl req -x509 -new -key "$1.key" -out "$1.pem" -days "$days" -subj "/CN=$2" 2>/dev/null
}
leaf() {  # NAME CN CA SANS
  key "$1.key"
  openssl req -new -key "$1.key" -out "$1.csr" -subj "/CN=$2" 2>/dev/null
  printf 'subjectAltName=%s\n' "$4" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$3.pem" -CAkey "$3.key" -CAcreateserial -out "$1.pem" \
    -days "$days" -extfile "$1.ext" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
ca ca preft-dev-ca
ca rogue-ca preft-rogue-ca
leaf server preft-server ca "IP:127.0.0.1,DNS:localhost${PREFT_CERT_SANS:+,$PREFT_CERT_SANS}"
leaf client preft-client ca "DNS:preft-client"
leaf rogue preft-rogue rogue-ca "DNS:preft-rogue"
rm -f ./*.srl
echo "certificates in $dir"
