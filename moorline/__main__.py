from moorline.cli import main

main()
