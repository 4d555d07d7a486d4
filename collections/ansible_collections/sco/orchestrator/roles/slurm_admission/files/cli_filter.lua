--[[
SCO client-side defaults (cli_filter/lua; CliFilterPlugins=lua; this file beside slurm.conf).

Batch jobs that set no --signal get B:USR1@120: the batch shell is warned 120 s (the reclaim notice window)
before its time limit with the same signal the drain sends, so one USR1 handler covers both. job_submit/lua
cannot do this in Slurm 22.05 (warn_signal is not exposed there).
--]]

local DEFAULT_SIGNAL = "B:USR1@120"

function slurm_cli_setup_defaults(options, early_pass)
  return slurm.SUCCESS
end

function slurm_cli_pre_submit(options, pack_offset)
  local kind = options["type"]
  local sig = options["signal"]
  if (kind == nil or kind == "sbatch") and (sig == nil or sig == "" or sig == "0@0") then
    options["signal"] = DEFAULT_SIGNAL
  end
  return slurm.SUCCESS
end

function slurm_cli_post_submit(offset, jobid, stepid)
  return slurm.SUCCESS
end
