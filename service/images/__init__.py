"""Container images' registry logins (issue 44): a user's or a team's, stored sealed, lent to the worker that pulls
a job's image and to no one else."""
