#!/usr/bin/env bash
# Download Llama weights with the signed URL from Meta's approval email.
#
# Usage: ./download.sh [VERSION]      VERSION: 2, 3, 3.1, 3.2, 3.3 or 4 (optional)
#
# It asks what Meta's own download scripts ask, one answer per line, from the terminal or
# from stdin when it is piped:
#   1. "Enter the URL from email: "  the signed URL; it contains one '*'
#   2. "Enter the list of models to download without spaces (...), or press Enter for all: "
#      with the names Meta uses:
#        Llama 2:   7B,13B,70B,7B-chat,13B-chat,70B-chat                    (Meta's llama download.sh)
#        Llama 3:   8B,8B-instruct,70B,70B-instruct                         (Meta's llama3 download.sh)
#        Llama 3.1: Llama3.1-8B,Llama3.1-8B-Instruct,Llama3.1-70B,Llama3.1-70B-Instruct,
#                   Llama3.1-405B:bf16-mp8,Llama3.1-405B:bf16-mp16,
#                   Llama3.1-405B-Instruct:bf16-mp8,Llama3.1-405B-Instruct:bf16-mp16
#        Llama 3.2: Llama3.2-1B,Llama3.2-3B,Llama3.2-1B-Instruct,Llama3.2-3B-Instruct
#        Llama 3.3: Llama3.3-70B-Instruct
#        Llama 4:   Llama-4-Scout-17B-16E,Llama-4-Scout-17B-16E-Instruct,
#                   Llama-4-Maverick-17B-128E,Llama-4-Maverick-17B-128E-Instruct
#      (3.1 and later: the model ids of Meta's `llama model download`; with VERSION given,
#      the part after the version will do, e.g. "8B-Instruct" for Llama 3.1.)
#   3. "Enter the Llama version to download (...): "  asked only when the names leave the
#      version open ("70B" is both a Llama 2 and a Llama 3 model) or Enter asked for all.
# One version per run; names are case-insensitive. Answering question 2 with a version number
# ("3") is also accepted, and then the model list is asked for that version.
#   printf '%s\n' "$URL" 7B,13B-chat | ./download.sh                 # Llama 2, as Meta's script
#   printf '%s\n' "$URL" 70B 3 | ./download.sh                       # 70B: which version? 3
#   printf '%s\n' "$URL" Llama3.2-1B-Instruct | TARGET_FOLDER=weights ./download.sh
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
#   Llama 3.1, 3.2, 3.3, 4: one folder per model, named by its model id (':' as '-', as
#            `llama model download` names it: Llama3.1-8B-Instruct/, Llama3.1-405B-bf16-mp16/,
#            Llama-4-Scout-17B-16E/), holding checklist.chk  tokenizer.model  params.json
#            consolidated.*.pth (Llama 3.1 405B: 8 or 16 shards; 3.3 70B and Llama 4: 8).
#
# A file's URL is the signed URL with its '*' replaced by the file's path on Meta's server.
# Running the script again with the same answers resumes interrupted downloads. Every line of
# every checklist is verified, with md5sum or, where that is missing (macOS), with `md5 -r`.
# An unknown model name, an expired link (HTTP 403), a missing file (HTTP 404) or a checksum
# mismatch stops the script with a message naming the problem and a non-zero exit status;
# folders it made are removed again if they are left empty.

set -euo pipefail
set -f # no globbing: model names and file names are used unquoted in lists

made_dirs=() # folders this run created, removed again on failure if left empty

# remove_empty_made_dirs: rmdir what this run created and left empty (innermost first).
remove_empty_made_dirs() {
    local i
    for ((i = ${#made_dirs[@]} - 1; i >= 0; i--)); do
        rmdir "${made_dirs[i]}" 2>/dev/null || true
    done
}

die() {
    printf 'download.sh: %s\n' "$*" >&2
    remove_empty_made_dirs
    exit 1
}

# make_dir DIR: mkdir -p, remembering each folder it creates.
make_dir() {
    local missing=() d=$1
    while [ ! -d "$d" ]; do
        missing+=("$d")
        [ "$d" != "$(dirname "$d")" ] || break
        d=$(dirname "$d")
    done
    mkdir -p "$1"
    local i
    for ((i = ${#missing[@]} - 1; i >= 0; i--)); do made_dirs+=("${missing[i]}"); done
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

VERSIONS="2 3 3.1 3.2 3.3 4"

# model_spec VERSION NAME: print "<local folder> <folder on the server> <number of shards>".
# Llama 3 files sit in differently named folders on the server than on disk. From 3.1 on, NAME
# is Meta's model id (Llama3.1-8B) or the part after the version (8B); the server folders and
# local folders are those of llama-models' sku_list / `llama model download`.
model_spec() {
    local name
    name=$(lower "$2")
    case "$1" in
        3.1 | 3.2 | 3.3) name=${name#llama"$1"-} ;;
        4) name=${name#llama-4-} ;;
    esac
    case "$1:$name" in
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
        3.1:8b) echo "Llama3.1-8B Llama-3.1-8B 1" ;;
        3.1:8b-instruct) echo "Llama3.1-8B-Instruct Llama-3.1-8B-Instruct 1" ;;
        3.1:70b) echo "Llama3.1-70B Llama-3.1-70B 8" ;;
        3.1:70b-instruct) echo "Llama3.1-70B-Instruct Llama-3.1-70B-Instruct 8" ;;
        3.1:405b:bf16-mp8) echo "Llama3.1-405B-bf16-mp8 Llama-3.1-405B-MP8 8" ;;
        3.1:405b:bf16-mp16) echo "Llama3.1-405B-bf16-mp16 Llama-3.1-405B-MP16 16" ;;
        3.1:405b-instruct:bf16-mp8) echo "Llama3.1-405B-Instruct-bf16-mp8 Llama-3.1-405B-Instruct-MP8 8" ;;
        3.1:405b-instruct:bf16-mp16) echo "Llama3.1-405B-Instruct-bf16-mp16 Llama-3.1-405B-Instruct-MP16 16" ;;
        3.2:1b) echo "Llama3.2-1B Llama-3.2-1B 1" ;;
        3.2:3b) echo "Llama3.2-3B Llama-3.2-3B 1" ;;
        3.2:1b-instruct) echo "Llama3.2-1B-Instruct Llama-3.2-1B-Instruct 1" ;;
        3.2:3b-instruct) echo "Llama3.2-3B-Instruct Llama-3.2-3B-Instruct 1" ;;
        3.3:70b-instruct) echo "Llama3.3-70B-Instruct Llama-3.3-70B-Instruct 8" ;;
        4:scout-17b-16e) echo "Llama-4-Scout-17B-16E Llama-4-Scout-17B-16E 8" ;;
        4:scout-17b-16e-instruct) echo "Llama-4-Scout-17B-16E-Instruct Llama-4-Scout-17B-16E-Instruct 8" ;;
        4:maverick-17b-128e) echo "Llama-4-Maverick-17B-128E Llama-4-Maverick-17B-128E 8" ;;
        4:maverick-17b-128e-instruct) echo "Llama-4-Maverick-17B-128E-Instruct Llama-4-Maverick-17B-128E-Instruct 8" ;;
        *) return 1 ;;
    esac
}

# models_of VERSION: the model names of VERSION, comma-separated, as the question lists them.
models_of() {
    case "$1" in
        2) echo "7B,13B,70B,7B-chat,13B-chat,70B-chat" ;;
        3) echo "8B,8B-instruct,70B,70B-instruct" ;;
        3.1) echo "Llama3.1-8B,Llama3.1-8B-Instruct,Llama3.1-70B,Llama3.1-70B-Instruct,Llama3.1-405B:bf16-mp8,Llama3.1-405B:bf16-mp16,Llama3.1-405B-Instruct:bf16-mp8,Llama3.1-405B-Instruct:bf16-mp16" ;;
        3.2) echo "Llama3.2-1B,Llama3.2-3B,Llama3.2-1B-Instruct,Llama3.2-3B-Instruct" ;;
        3.3) echo "Llama3.3-70B-Instruct" ;;
        4) echo "Llama-4-Scout-17B-16E,Llama-4-Scout-17B-16E-Instruct,Llama-4-Maverick-17B-128E,Llama-4-Maverick-17B-128E-Instruct" ;;
    esac
}

# normalize_version TEXT: "2", "3", "3.1", ... for answers such as "3.1", "Llama 3.1", "llama-4";
# prints nothing for anything else.
normalize_version() {
    local v
    v=$(lower "$1" | tr -d ' _-')
    v=${v#llama}
    case " $VERSIONS " in
        *" $v "*) echo "$v" ;;
    esac
}

# versions_of NAME: the versions NAME is a model of, space-separated. Without a version given,
# the short names are Llama 2's and Llama 3's (Meta's scripts for those asked no version); from
# 3.1 on a name must be the whole model id.
versions_of() {
    local v found=""
    for v in $VERSIONS; do
        case "$v:$(lower "$1")" in
            2:* | 3:* | 3.[123]:llama3.[123]-* | 4:llama-4-*)
                if model_spec "$v" "$1" >/dev/null; then found="$found $v"; fi ;;
        esac
    done
    echo "${found# }"
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
[ "$#" -le 1 ] || die "too many arguments; usage: ./download.sh [VERSION]"

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

version=""
if [ "$#" -eq 1 ]; then
    version=$(normalize_version "$1")
    [ -n "$version" ] || die "unknown Llama version '$1'; give one of: ${VERSIONS// /, }."
fi

signed_url="" # set by ask
ask signed_url "Enter the URL from email: "
echo ""
case "$signed_url" in
    "") die "no URL given." ;;
    *\**) ;;
    *) die "the URL has no '*'; paste the whole link from the email." ;;
esac

models="" # set by ask
if [ -n "$version" ]; then
    choices=$(models_of "$version")
else
    choices=""
    for v in $VERSIONS; do choices="$choices${choices:+,}$(models_of "$v")"; done
fi
ask models "Enter the list of models to download without spaces ($choices), or press Enter for all: "
if [ -z "$version" ] && [ -n "$models" ] && [ -n "$(normalize_version "$models")" ] &&
    [ -z "$(versions_of "$models")" ]; then
    # A version number where the models were asked (the order of this script's older versions).
    version=$(normalize_version "$models")
    ask models "Enter the list of models to download without spaces ($(models_of "$version")), or press Enter for all: "
fi

if [ -z "$version" ]; then
    # The version the names leave possible: every name must belong to it.
    candidates=""
    if [ -n "$models" ]; then
        candidates=$VERSIONS
        for m in ${models//,/ }; do
            of=" $(versions_of "$m") "
            [ "$of" != "  " ] || die "unknown model '$m'; choose from $choices."
            kept=""
            for v in $candidates; do
                case "$of" in *" $v "*) kept="$kept $v" ;; esac
            done
            candidates=${kept# }
            [ -n "$candidates" ] || die "'$models' mixes models of different Llama versions; download one version per run."
        done
    fi
    case "$candidates" in
        *" "* | "")
            [ -n "$candidates" ] || candidates=$VERSIONS
            ask version "Enter the Llama version to download (${candidates// /, }): "
            answer=$version
            version=$(normalize_version "$version")
            case " $candidates " in
                *" ${version:-none} "*) ;;
                *) die "unknown Llama version '$answer'${models:+ for $models}; answer one of: ${candidates// /, }." ;;
            esac
            ;;
        *) version=$candidates ;;
    esac
fi

all_models=$(models_of "$version")
models=${models:-$all_models}
for m in ${models//,/ }; do
    model_spec "$version" "$m" >/dev/null ||
        die "unknown Llama $version model '$m'; choose from $all_models."
done
case "$version" in
    2)
        top_files="LICENSE:LICENSE USE_POLICY.md:USE_POLICY.md"
        model_files="params.json"
        ;;
    3)
        top_files="LICENSE:LICENSE USE_POLICY.md:USE_POLICY"
        model_files="params.json tokenizer.model"
        ;;
    *) # llama-models' download list: no files outside the model's folder
        top_files=""
        model_files="tokenizer.model params.json"
        ;;
esac

target=${TARGET_FOLDER:-.}
make_dir "$target"
trap 'remove_empty_made_dirs; exit 130' INT
trap 'remove_empty_made_dirs; exit 143' TERM
if [ "$downloader" = wget ]; then
    wget_log=$(mktemp "${TMPDIR:-/tmp}/download.sh.XXXXXX")
    trap 'rm -f "$wget_log"' EXIT
fi

# --- downloads ---------------------------------------------------------------------------------

for pair in $top_files; do
    download "${pair%%:*}" "${pair#*:}" fresh
done

if [ "$version" = 2 ]; then # one tokenizer, shared by all Llama 2 models
    download tokenizer_checklist.chk tokenizer_checklist.chk fresh
    download tokenizer.model tokenizer.model resume
    verify "" tokenizer_checklist.chk
fi

for m in ${models//,/ }; do
    read -r folder remote shards <<<"$(model_spec "$version" "$m")"
    make_dir "$target/$folder"
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
