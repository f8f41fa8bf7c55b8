"""What every `tf-psx` subcommand shares: the program's name and its exit statuses."""

PROG = "tf-psx"
EXIT_OK = 0
# argparse exits with 2 on bad usage; every other bad input exits the same way.
EXIT_USAGE = 2
