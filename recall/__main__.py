from recall.cli.app import main

main()
