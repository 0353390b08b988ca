from worker.train.main import main

main()
