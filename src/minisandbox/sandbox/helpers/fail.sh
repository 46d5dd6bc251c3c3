# Prelude of the file helpers: `fail MESSAGE` prints MESSAGE (a tool's error, untranslated:
# LC_ALL=C) and exits with a status that names its cause for the host
# (minisandbox.sandbox.files.CAUSES): 65 no such file, 66 permission denied, 67 is a directory,
# 68 not a directory, 69 too many levels of symbolic links, 70 read-only file system,
# 71 no space left, 72 file name too long, 73 file exists; 1 any other cause.
# The host's own tools by absolute PATH (/usr is read-only inside).
PATH=/usr/bin:/bin
LC_ALL=C
export PATH LC_ALL

fail() {
    printf '%s\n' "$1" >&2
    case $1 in
        *"No such file or directory"*) exit 65 ;;
        *"Permission denied"*) exit 66 ;;
        *"Is a directory"*) exit 67 ;;
        *"Not a directory"*) exit 68 ;;
        *"Too many levels of symbolic links"*) exit 69 ;;
        *"Read-only file system"*) exit 70 ;;
        *"No space left on device"*|*"Disk quota exceeded"*) exit 71 ;;
        *"File name too long"*) exit 72 ;;
        *"File exists"*) exit 73 ;;
    esac
    exit 1
}
