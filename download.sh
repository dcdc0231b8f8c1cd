#!/usr/bin/env bash
# Download Llama 2 or Llama 3 weights with the signed URL from Meta's approval email.
#
# Usage: ./download.sh [2|3]
#
# Answers are read one per line from the terminal, or from stdin when it is piped:
#   1. "Enter the URL from email: "  the signed URL; it contains one '*'
#   2. "Enter the Llama version to download (2 or 3): "  skipped when 2 or 3 is given as argument
#   3. Meta's question for that version, "Enter the list of models to download without
#      spaces (...), or press Enter for all: ", with the names Meta uses:
#        Llama 2: 7B,13B,70B,7B-chat,13B-chat,70B-chat
#        Llama 3: 8B,8B-instruct,70B,70B-instruct
# The version is never guessed from the model names: "70B" is both a Llama 2 and a Llama 3 model.
#   printf '%s\n' "$URL" 7B,13B-chat | ./download.sh 2
#   printf '%s\n' "$URL" 3 8B-instruct | ./download.sh
#
# Environment:
#   TARGET_FOLDER  where the files go (default: .)
#   DOWNLOADER     curl or wget (default: curl where installed, else wget)
#
# Layout under TARGET_FOLDER (a model's shards are consolidated.00.pth .. consolidated.NN.pth):
#   Llama 2: LICENSE  USE_POLICY.md  tokenizer.model  tokenizer_checklist.chk
#            llama-2-{7b,13b,70b}[-chat]/  consolidated.*.pth  params.json  checklist.chk
#   Llama 3: LICENSE  USE_POLICY.md
#            Meta-Llama-3-{8B,70B}[-Instruct]/  consolidated.*.pth  params.json  tokenizer.model
#                                               checklist.chk
#
# A file's URL is the signed URL with its '*' replaced by the file's path on Meta's server.
# Running the script again with the same answers resumes interrupted downloads. Every line of
# every checklist is verified, with md5sum or, where that is missing (macOS), with `md5 -r`.
# An unknown model name, an expired link (HTTP 403), a missing file (HTTP 404) or a checksum
# mismatch stops the script with a message naming the problem and a non-zero exit status.

set -euo pipefail
set -f # no globbing: model names and file names are used unquoted in lists

die() {
    printf 'download.sh: %s\n' "$*" >&2
    exit 1
}

lower() {
    printf '%s' "$1" | tr '[:upper:]' '[:lower:]'
}

# ask VAR PROMPT: read one answer line into VAR, all whitespace removed (none belongs in a URL
# or a model list). An empty line is an answer ("press Enter"); the end of input is not.
ask() {
    local reply=""
    if ! IFS= read -r -p "$2" reply && [ -z "$reply" ]; then
        die "no answer to \"$2\" (input ended)"
    fi
    reply=$(printf '%s' "$reply" | tr -d '[:space:]')
    printf -v "$1" '%s' "$reply"
}

# model_spec VERSION NAME: print "<local folder> <folder on the server> <number of shards>".
# Llama 3 files sit in differently named folders on the server than on disk.
model_spec() {
    case "$1:$(lower "$2")" in
        2:7b) echo "llama-2-7b llama-2-7b 1" ;;
        2:7b-chat) echo "llama-2-7b-chat llama-2-7b-chat 1" ;;
        2:13b) echo "llama-2-13b llama-2-13b 2" ;;
        2:13b-chat) echo "llama-2-13b-chat llama-2-13b-chat 2" ;;
        2:70b) echo "llama-2-70b llama-2-70b 8" ;;
        2:70b-chat) echo "llama-2-70b-chat llama-2-70b-chat 8" ;;
        3:8b) echo "Meta-Llama-3-8B 8b_pre_trained 1" ;;
        3:8b-instruct) echo "Meta-Llama-3-8B-Instruct 8b_instruction_tuned 1" ;;
        3:70b) echo "Meta-Llama-3-70B 70b_pre_trained 8" ;;
        3:70b-instruct) echo "Meta-Llama-3-70B-Instruct 70b_instruction_tuned 8" ;;
        *) return 1 ;;
    esac
}

# url_for SERVER_PATH: the signed URL with its '*' replaced by SERVER_PATH.
url_for() {
    printf '%s%s%s' "${signed_url%%\**}" "$1" "${signed_url#*\*}"
}

# download FILE SERVER_PATH MODE: fetch TARGET_FOLDER/FILE. MODE "resume" continues a partial
# file (safe for files a checklist verifies); "fresh" replaces the file only once fully fetched.
download() {
    local file=$1 src=$2 mode=$3 dest out status=0 code=""
    dest="$target/$file"
    out=$dest
    if [ "$mode" = fresh ]; then
        out="$dest.part"
        rm -f "$out"
    fi
    if [ "$mode" = resume ] && [ -s "$dest" ]; then
        echo "Resuming $file"
    else
        echo "Downloading $file"
    fi
    if [ "$downloader" = curl ]; then
        local opts=(--fail --location --progress-bar --output "$out" --write-out '%{http_code}')
        [ "$mode" = fresh ] || opts+=(--continue-at -)
        code=$(curl "${opts[@]}" "$(url_for "$src")") || status=$?
    else
        local opts=(--progress=bar:force --output-document "$out")
        [ "$mode" = fresh ] || opts+=(--continue)
        # wget prints the HTTP status only in its (untranslated, with LC_ALL=C) messages.
        LC_ALL=C wget "${opts[@]}" "$(url_for "$src")" 2>&1 | tee "$wget_log" >&2 ||
            status=${PIPESTATUS[0]}
        code=$(sed -n 's/.*awaiting response\.\.\. \([0-9][0-9]*\).*/\1/p' "$wget_log" | tail -n 1)
    fi
    if [ "$code" = 416 ] && [ "$mode" = resume ] && [ -s "$out" ]; then
        # Range Not Satisfiable: nothing is left to fetch. curl calls that an error, wget does not.
        echo "$file was already complete"
        return 0
    fi
    if [ "$status" -eq 0 ]; then
        if [ "$mode" = fresh ]; then mv -f "$out" "$dest"; fi
        return 0
    fi
    if [ "$mode" = fresh ] || [ ! -s "$out" ]; then rm -f "$out"; fi # keep only partials to resume
    [ "$code" != 000 ] || code="" # curl's code when no HTTP response came
    case "$code" in
        403) die "$file: HTTP 403 Forbidden. The download link has expired or been used too many" \
            "times; request a new one from Meta and run the script again." ;;
        404) die "$file: HTTP 404 Not Found at '$src' on the server. Is this a Llama $version link," \
            "and was this model in the email?" ;;
        *) die "$file: download failed ($downloader exit status $status${code:+, HTTP $code})." ;;
    esac
}

# md5_of FILE: FILE's md5 as lowercase hex. md5sum prints "<md5>  <file>", md5 -r "<md5> <file>".
md5_of() {
    local out
    out=$("${md5_cmd[@]}" "$1")
    lower "${out%% *}"
}

# verify FOLDER CHECKLIST: check every "<md5>  <file>" line of CHECKLIST in FOLDER (relative to
# TARGET_FOLDER, "" for the top); report each listed file that is missing or differs, then exit
# if any did.
verify() {
    local folder=$1 list=$2 dir sum name rel bad="" count=0
    dir="$target${folder:+/$folder}"
    echo "Checking checksums in ${folder:+$folder/}$list"
    while read -r sum name || [ -n "$sum" ]; do
        [ -n "$sum" ] || continue
        name=${name%$'\r'}
        name=${name#\*} # md5sum's binary-mode marker
        rel="${folder:+$folder/}$name"
        if [ "${#sum}" -ne 32 ] || [ -z "$name" ] || [ -n "${sum//[0-9a-fA-F]/}" ]; then
            die "$list: not an md5sum line: '$sum $name'"
        fi
        count=$((count + 1))
        if [ ! -f "$dir/$name" ]; then
            echo "download.sh: missing file listed in ${folder:+$folder/}$list: $rel" >&2
            bad="$bad $rel"
        elif [ "$(md5_of "$dir/$name")" != "$(lower "$sum")" ]; then
            echo "download.sh: checksum mismatch: $rel" >&2
            bad="$bad $rel"
        else
            echo "$rel: OK"
        fi
    done <"$dir/$list"
    [ "$count" -gt 0 ] || die "${folder:+$folder/}$list lists no files, so nothing was verified."
    if [ -n "$bad" ]; then
        die "verification failed for:$bad. Delete these files and run the script again."
    fi
}

# --- arguments, tools and answers ------------------------------------------------------------

case "${1:-}" in
    -h | --help)
        sed -n '2,/^$/s/^# \{0,1\}//p' "$0"
        exit 0
        ;;
esac
[ "$#" -le 1 ] || die "too many arguments; usage: ./download.sh [2|3]"

downloader=${DOWNLOADER:-}
if [ -z "$downloader" ]; then
    if command -v curl >/dev/null 2>&1; then
        downloader=curl
    elif command -v wget >/dev/null 2>&1; then
        downloader=wget
    else
        die "neither curl nor wget is installed; install one of them."
    fi
fi
case "$downloader" in
    curl | wget) command -v "$downloader" >/dev/null 2>&1 || die "$downloader is not installed." ;;
    *) die "DOWNLOADER must be curl or wget, not '$downloader'." ;;
esac
if command -v md5sum >/dev/null 2>&1; then
    md5_cmd=(md5sum)
elif command -v md5 >/dev/null 2>&1; then
    md5_cmd=(md5 -r)
else
    die "neither md5sum nor md5 is installed; checksums cannot be verified."
fi

signed_url="" # set by ask
ask signed_url "Enter the URL from email: "
echo ""
case "$signed_url" in
    "") die "no URL given." ;;
    *\**) ;;
    *) die "the URL has no '*'; paste the whole link from the email." ;;
esac

version=${1:-}
[ -n "$version" ] || ask version "Enter the Llama version to download (2 or 3): "
version=$(lower "$version" | tr -d ' _-')
version=${version#llama}
case "$version" in
    2)
        all_models="7B,13B,70B,7B-chat,13B-chat,70B-chat"
        policy_on_server=USE_POLICY.md
        model_files="params.json"
        ;;
    3)
        all_models="8B,8B-instruct,70B,70B-instruct"
        policy_on_server=USE_POLICY
        model_files="params.json tokenizer.model"
        ;;
    *) die "unknown Llama version '$version'; answer 2 or 3." ;;
esac

ask models "Enter the list of models to download without spaces ($all_models), or press Enter for all: "
models=${models:-$all_models}
for m in ${models//,/ }; do
    model_spec "$version" "$m" >/dev/null ||
        die "unknown Llama $version model '$m'; choose from $all_models."
done

target=${TARGET_FOLDER:-.}
mkdir -p "$target"
if [ "$downloader" = wget ]; then
    wget_log=$(mktemp "${TMPDIR:-/tmp}/download.sh.XXXXXX")
    trap 'rm -f "$wget_log"' EXIT
fi

# --- downloads ---------------------------------------------------------------------------------

download LICENSE LICENSE fresh
download USE_POLICY.md "$policy_on_server" fresh

if [ "$version" = 2 ]; then # one tokenizer, shared by all Llama 2 models
    download tokenizer_checklist.chk tokenizer_checklist.chk fresh
    download tokenizer.model tokenizer.model resume
    verify "" tokenizer_checklist.chk
fi

for m in ${models//,/ }; do
    read -r folder remote shards <<<"$(model_spec "$version" "$m")"
    mkdir -p "$target/$folder"
    # The checklist first: an expired link or a wrong model fails before the big files.
    download "$folder/checklist.chk" "$remote/checklist.chk" fresh
    for ((s = 0; s < shards; s++)); do
        shard=$(printf 'consolidated.%02d.pth' "$s")
        download "$folder/$shard" "$remote/$shard" resume
    done
    for f in $model_files; do
        download "$folder/$f" "$remote/$f" resume
    done
    verify "$folder" checklist.chk
done

echo "Done: Llama $version ${models//,/, } in $target"
