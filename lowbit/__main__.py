from lowbit.cli.main import main

main()
