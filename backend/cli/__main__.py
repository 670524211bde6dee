from backend.cli.main import main

main()
