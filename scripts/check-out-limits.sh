#!/bin/bash
# Checks a folder against the limits of what the device tool brings back from $OUT (its README,
# "Limits"): at most 8 files, each under 16 MiB, 64 MiB in all, none deeper than DIR/a/b/file,
# every file and folder named in letters, digits, '.', '_' and '-' alone, nothing but plain files
# and folders (no links, sockets, pipes, devices); every .tar.gz readable (tar -tzf); and each
# REQUIRED file present and non-empty. Prints one line per file (bytes, path) and each violation;
# exit status 1 when any limit is broken, 2 on bad arguments.
#
#   scripts/check-out-limits.sh DIR [REQUIRED_FILE...]     # e.g. DIR gpu-check.md gpu-check.jsonl
#
# scripts/device-check.sh runs it on its own $OUT; CI (.ci/run) and cli/tests/device_check.rs run
# it on a rehearsal of the device call on the sim device.
set -uo pipefail
if [ $# -lt 1 ] || [ ! -d "$1" ]; then
  echo "usage: $0 DIR [REQUIRED_FILE...]   (DIR: an existing folder, as \$OUT after the device call)" >&2
  exit 2
fi
DIR=${1%/}
shift
MAX_FILES=8 MAX_FILE_BYTES=$((16 << 20)) MAX_TOTAL_BYTES=$((64 << 20)) MAX_FOLDERS=2
bad=0
violation() { echo "LIMIT: $*"; bad=1; }

files=0 total=0
while IFS= read -r -d '' path; do
  rel=${path#"$DIR"/}
  [[ "$rel" != *$'\n'* ]] || violation "a name with a line break: $(printf %q "$rel")"
  # Every component's name, and the depth (folders above the file).
  IFS=/ read -r -a parts <<<"$rel"
  for p in "${parts[@]}"; do
    [[ "$p" =~ ^[A-Za-z0-9._-]+$ ]] || violation "$rel: the name '$p' has characters other than letters, digits, '.', '_', '-'"
  done
  if [ -L "$path" ]; then
    violation "$rel: a symbolic link (only plain files come back)"
  elif [ -d "$path" ]; then
    [ "${#parts[@]}" -le "$MAX_FOLDERS" ] || violation "$rel/: a folder ${#parts[@]} deep (at most $MAX_FOLDERS: \$OUT/a/b/file)"
  elif [ -f "$path" ]; then
    files=$((files + 1))
    bytes=$(stat -c %s "$path")
    total=$((total + bytes))
    printf '%10d  %s\n' "$bytes" "$rel"
    [ "$((${#parts[@]} - 1))" -le "$MAX_FOLDERS" ] || violation "$rel: $((${#parts[@]} - 1)) folders deep (at most $MAX_FOLDERS: \$OUT/a/b/file)"
    [ "$bytes" -lt "$MAX_FILE_BYTES" ] || violation "$rel: $bytes bytes (each file under $MAX_FILE_BYTES, 16 MiB)"
    if [[ "$rel" == *.tar.gz ]] && ! tar -tzf "$path" >/dev/null 2>&1; then
      violation "$rel: not a readable gzip'd tar (tar -tzf failed)"
    fi
  else
    violation "$rel: neither a plain file nor a folder ($(stat -c %F "$path"))"
  fi
done < <(find "$DIR" -mindepth 1 -print0 | sort -z)

[ "$files" -le "$MAX_FILES" ] || violation "$files files (at most $MAX_FILES)"
[ "$total" -le "$MAX_TOTAL_BYTES" ] || violation "$total bytes in all (at most $MAX_TOTAL_BYTES, 64 MiB)"
for req in "$@"; do
  [ -s "$DIR/$req" ] || violation "$req: missing or empty (required)"
done
echo "$files files, $total bytes in $DIR: $([ "$bad" = 0 ] && echo "within the device tool's limits" || echo "LIMITS BROKEN")"
exit "$bad"
