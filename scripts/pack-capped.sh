#!/bin/bash
# Packs a folder into one gzip'd tar of at most CAP_BYTES (scripts/device-check.sh: the per-check
# logs, partial rows and traces of `oogc gpu-check`, under the device tool's 16 MiB a file). When
# the tarball is over the cap, the largest files are cut (a log keeps its head and its tail, any
# other file its head: a Chrome trace cut so still loads) or, under 64 KiB, dropped, until it
# fits; DIR/MANIFEST.txt, packed with it, lists every file as found and what was cut or dropped.
# DIR is changed in place (a staging copy). Prints one line per cut, and the result.
#
#   scripts/pack-capped.sh DEST.tar.gz CAP_BYTES DIR     # the tarball holds DIR's name as its top folder
#
# Exit status 1 when even the manifest and rows/ alone do not fit (then DEST is removed).
set -euo pipefail
if [ $# -ne 3 ] || [ ! -d "$3" ] || ! [[ "$2" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 DEST.tar.gz CAP_BYTES DIR   (DIR: an existing folder; CAP_BYTES: a number)" >&2
  exit 2
fi
DEST=$1 CAP=$2 DIR=${3%/}
NAME=$(basename "$DIR") PARENT=$(dirname "$DIR")
ACTIONS=()
FOUND=$(cd "$DIR" && find . -type f ! -name MANIFEST.txt -printf '%12s  %P\n' | sort -k2)

manifest() {
  {
    echo "$NAME.tar.gz: packed by scripts/pack-capped.sh at $(date -u '+%F %T UTC'), at most $CAP bytes compressed"
    echo
    echo "cut or dropped to fit (the largest first; a cut log keeps its head and tail, any other file its head):"
    if [ ${#ACTIONS[@]} = 0 ]; then echo "  nothing"; else printf '  %s\n' "${ACTIONS[@]}"; fi
    echo
    echo "files as found (bytes, path):"
    if [ -n "$FOUND" ]; then echo "$FOUND"; else echo "  none"; fi
  } >"$DIR/MANIFEST.txt"
}

# cut_file FILE KEEP_BYTES: in place, KEEP_BYTES of it (and a line saying how much went).
cut_file() {
  local f=$1 keep=$2 size
  size=$(stat -c %s "$f")
  case "$f" in
    *.log | *.stdout | *.stderr | *.txt | *.md)
      { head -c $((keep / 2)) "$f"
        printf '\n[... %d bytes cut here by scripts/pack-capped.sh to fit the tarball ...]\n' $((size - keep))
        tail -c $((keep / 2)) "$f"; } >"$f.cut" ;;
    *) head -c "$keep" "$f" >"$f.cut" ;;
  esac
  mv "$f.cut" "$f"
}

# The largest file but the manifest, rows/ last (the checks' rows and partial figures are what
# the report is made of): "BYTES PATH" relative to DIR, or nothing.
largest() {
  (cd "$DIR" && find . -type f ! -name MANIFEST.txt -printf '%s %P\n' \
    | awk '{ print ($2 ~ /^rows\//) ? 1 : 0, $0 }' | sort -k1,1n -k2,2nr | awk 'NR == 1 { sub(/^[01] /, ""); print }')
}

# Raw bytes that no cap this size can hold (text compresses ~10x): cut before the first round.
RAW_CAP=$((CAP * 8))
while IFS= read -r line; do
  bytes=${line%% *} rel=${line#* }
  if [ "$bytes" -gt "$RAW_CAP" ]; then
    cut_file "$DIR/$rel" "$RAW_CAP"
    ACTIONS+=("cut $rel from $bytes to $RAW_CAP bytes (over 8 times the cap)")
    echo "pack: cut $rel from $bytes to $RAW_CAP bytes"
  fi
done < <(cd "$DIR" && find . -type f ! -name MANIFEST.txt -printf '%s %P\n')

# Writes the manifest and the tarball; exits 0, saying so with $1, when it fits.
pack_or_go_on() {
  manifest
  tar -C "$PARENT" -czf "$DEST" "$NAME"
  size=$(stat -c %s "$DEST")
  if [ "$size" -le "$CAP" ]; then
    echo "pack: $DEST: $size bytes (cap $CAP), ${#ACTIONS[@]} cut or dropped: $1"
    exit 0
  fi
}

for round in $(seq 1 12); do
  pack_or_go_on "round $round"
  raw=$(find "$DIR" -type f -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }')
  # Raw bytes to remove: the excess over 95 % of the cap at this tarball's compression ratio.
  need=$(((size - CAP * 19 / 20) * raw / size + 4096))
  while [ "$need" -gt 0 ]; do
    line=$(largest)
    [ -n "$line" ] || break
    bytes=${line%% *} rel=${line#* }
    if [ "$bytes" -le 65536 ]; then
      rm -f "$DIR/$rel"
      ACTIONS+=("dropped $rel ($bytes bytes)")
      echo "pack: dropped $rel ($bytes bytes)"
      need=$((need - bytes))
    else
      cut=$need
      [ "$cut" -le $((bytes * 3 / 4)) ] || cut=$((bytes * 3 / 4))
      cut_file "$DIR/$rel" $((bytes - cut))
      ACTIONS+=("cut $rel from $bytes to $((bytes - cut)) bytes")
      echo "pack: cut $rel from $bytes to $((bytes - cut)) bytes"
      need=$((need - cut))
    fi
  done
done

# Still over after 12 rounds: only the manifest and the rows.
find "$DIR" -mindepth 1 -maxdepth 1 ! -name MANIFEST.txt ! -name rows -exec rm -rf {} +
ACTIONS+=("dropped everything but MANIFEST.txt and rows/ (12 rounds of cutting did not fit the cap)")
pack_or_go_on "only MANIFEST.txt and rows/ kept"
rm -f "$DEST"
echo "pack: error: even MANIFEST.txt and rows/ are $size bytes compressed, over the cap of $CAP: no tarball" >&2
exit 1
