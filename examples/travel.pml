<schema name="travel">
  <system>You are a concise travel agent.</system>
  <module name="trip-plan">Plan a trip of <param name="duration" len="4"/> for a family of four.</module>
  <union>
    <module name="miami">Miami is a city in Florida with beaches, surfing and Cuban food.</module>
    <module name="tokyo">Tokyo is the capital of Japan, with temples, sushi and fast trains.
      <module name="kyoto">A side trip to Kyoto shows old wooden temples.</module>
    </module>
  </union>
  <scaffold name="plan-miami" modules="trip-plan miami"/>
</schema>
