#!/usr/bin/env bash
# Every flag a message or comment in the serving code tells users to pass ("start it with
# --adapters all-positions") exists: the --names quoted in C++ string literals under services/,
# tools/, common/serving/ and train/ are checked against the flags the binaries accept (their
# --help, every preft subcommand's included).
# Usage: flag_names_test.sh SOURCE_DIR PREFT ROUTER DECODE PREFILL
set -u
src=$1
preft=$2
shift 2
known=$(mktemp)
trap 'rm -f "$known"' EXIT
help_flags() { "$@" --help 2>&1 | grep -oE -- '--[a-z][a-z0-9-]*' || true; }
for binary in "$preft" "$@"; do help_flags "$binary"; done > "$known"
# preft's subcommands, and theirs (client generate, train sft, ...), one level down each.
for sub in $("$preft" --help | awk '/^Subcommands:/ {on = 1; next} on && NF {print $1}'); do
  help_flags "$preft" "$sub" >> "$known"
  for subsub in $("$preft" "$sub" --help 2>&1 | awk '/^Subcommands:/ {on = 1; next} on && NF {print $1}'); do
    help_flags "$preft" "$sub" "$subsub" >> "$known"
  done
done
sort -u -o "$known" "$known"
# Flags of other programs that messages may name.
printf '%s\n' --help --version >> "$known"

failures=0
checked=0
while IFS= read -r hit; do
  file=${hit%%:*}
  rest=${hit#*:}
  line=${rest%%:*}
  text=${rest#*:}
  for flag in $(grep -oE -- '--[a-z][a-z0-9-]*[a-z0-9]' <<< "$text"); do
    checked=$((checked + 1))
    if ! grep -qxF -- "$flag" "$known"; then
      echo "FAIL: $file:$line names $flag, which no binary accepts"
      failures=$((failures + 1))
    fi
  done
done < <(cd "$src" && grep -rnoE --include=*.cc --include=*.h '"[^"]*--[a-z][a-z0-9-]*[^"]*"' \
           services tools common/serving train)
echo "$checked flag names checked, $failures unknown"
[[ $checked -gt 20 && $failures -eq 0 ]]
