<prompt schema="travel">
  <trip-plan duration="3 days"/>
  <tokyo><kyoto/></tokyo>
  <user>Which two places should we visit first?</user>
</prompt>
